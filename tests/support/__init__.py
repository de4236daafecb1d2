"""Shared helpers of the test suites: locating ComfyUI, tiny models, dataset folders, a ComfyUI server.

``tests/`` has no ``__init__.py``; each suite's ``conftest.py`` puts ``tests/`` on ``sys.path`` so that
``import support`` works, and never imports the pack's root ``__init__.py`` (which needs ComfyUI).
"""
