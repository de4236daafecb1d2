"""bench.bench_remote_ranks runs (the harness cannot rot between runs) and counts what its table claims: ranks
sharing a fetch cache with claims fetch every block of the cache once, all ranks together."""

from __future__ import annotations

from support.s3server import MISSING, s3_available

import pytest

from bench.bench_remote_ranks import measure, parse_args

BLOCK = 4 << 20


@pytest.mark.skipif(not s3_available(), reason=MISSING)
def test_two_ranks_with_claims_fetch_each_block_once() -> None:
    size, results = measure(parse_args(["--n", "48", "--ranks", "2", "--runs", "1", "--step-ms", "0",
                                        "--latency-ms", "0", "--shard-mb", "8"]))
    assert size > BLOCK  # several blocks, so the two ranks want some of the same ones
    (claims,) = results[(2, "claims")]
    assert len(claims) == 2 and all(r["wait"] >= 0 for r in claims)
    assert sum(r["bytes"] for r in claims) == size  # every byte of the cache fetched once, by one rank or the other
    (unclaimed,) = results[(2, "no claims")]
    assert sum(r["bytes"] for r in unclaimed) >= size  # without claims a block may come twice, never less than once
