import pytest

from thinvm.errors import ThinvmError
from thinvm.host.memory import parse_meminfo
from thinvm.units import GiB, KiB, MiB, format_size, parse_rate, parse_size


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("2G", 2 * GiB),
        ("2g", 2 * GiB),
        ("512M", 512 * MiB),
        ("512MiB", 512 * MiB),
        ("1.5GiB", 3 * GiB // 2),
        ("300", 300 * MiB),
        ("4096k", 4 * MiB),
        ("1T", 1024 * GiB),
        ("123b", 123),
        (4096, 4096),
    ],
)
def test_parse_size(text: str | int, expected: int) -> None:
    assert parse_size(text) == expected


@pytest.mark.parametrize("text", ["", "G", "two gigs", "-1G", "1.5b", "1X"])
def test_parse_size_rejects_garbage(text: str) -> None:
    with pytest.raises(ThinvmError):
        parse_size(text)


def test_format_size() -> None:
    assert format_size(3 * GiB // 2) == "1.50 GiB"
    assert format_size(512 * MiB) == "512.00 MiB"
    assert format_size(12 * KiB) == "12.00 KiB"
    assert format_size(100) == "100 B"
    assert format_size(-2 * MiB) == "-2.00 MiB"


def test_parse_meminfo() -> None:
    text = "MemTotal:        2018764 kB\nMemFree:          123 kB\nHugePages_Total:       0\n"
    info = parse_meminfo(text)
    assert info["MemTotal"] == 2018764 * KiB
    assert info["MemFree"] == 123 * KiB
    assert info["HugePages_Total"] == 0


@pytest.mark.parametrize(
    ("text", "bits"),
    [("10gbit", 10_000_000_000), ("400mbit", 400_000_000), ("1.5Gbit", 1_500_000_000)],
)
def test_parse_rate_reads_tc_rates_in_decimal_units(text: str, bits: int) -> None:
    assert parse_rate(text) == bits


@pytest.mark.parametrize("text", ["10G", "fast", "10 gbps", ""])
def test_parse_rate_refuses_what_tc_would_not_read_as_a_rate(text: str) -> None:
    with pytest.raises(ThinvmError, match="link rate"):
        parse_rate(text)
