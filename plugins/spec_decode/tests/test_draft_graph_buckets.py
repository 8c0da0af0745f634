"""The buckets of the drafter's CUDA graphs (``draft_graphs.bucket_of``): few, covering every row count."""

from deepinfer_spec_decode.draft_graphs import bucket_of


def test_buckets_cover_every_row_count_with_bounded_padding():
    limit = 1024
    buckets = {bucket_of(rows, limit) for rows in range(1, limit + 1)}
    assert sorted(buckets)[:12] == [1, 2, 4, 8, 16, 24, 32, 40, 48, 56, 64, 96]
    assert len(buckets) == 23  # 4 to 8 rows, 7 to 64, 6 to 256, 6 to 1,024
    for rows in range(1, limit + 1):
        bucket = bucket_of(rows, limit)
        assert rows <= bucket <= limit
        assert bucket - rows < max(8, rows / 2)  # fewer than 8 padding rows, or than half the real ones


def test_rows_past_the_limit_run_eagerly():
    assert bucket_of(257, 256) is None
    assert bucket_of(250, 256) == 256
    assert bucket_of(100, 100) == 100  # a limit off the bucket grid is a bucket of its own
