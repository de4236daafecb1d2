// ComfyUI-StreamCache front-end extension. ComfyUI serves every *.js file under web/ (WEB_DIRECTORY) and
// imports it as an ES module; nodes report through the built-in progress bar and `ui` text for now.
import { app } from "../../../scripts/app.js";

app.registerExtension({
  name: "streamcache.core",
});
