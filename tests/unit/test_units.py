from dataset_cache.units import format_bytes


def test_format_bytes_units():
    assert format_bytes(0) == "0 B"
    assert format_bytes(1023) == "1023 B"
    assert format_bytes(1536) == "1.5 KiB"
    assert format_bytes(3 << 20) == "3.0 MiB"
    assert format_bytes(5 << 40) == "5.0 TiB"
