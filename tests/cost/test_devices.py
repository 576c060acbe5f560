"""Device specs are data with sources; a malformed file names file, key and value."""

import pytest

from fuel.cost import DeviceSpecError, PeakClass, UnknownDeviceError, device, device_names, load_devices
from fuel.cost.devices import parse_devices

ISSUE_DEVICES = [
    "h100-sxm", "h100-pcie", "h200-sxm", "a100-40gb", "a100-80gb", "l40s", "l4", "rtx-4090",
    "rtx-3090", "b200", "gb10", "mi300x", "m2-max", "m3-max",
]


def test_every_device_the_issue_lists_ships_with_sources():
    specs = load_devices()
    for name in ISSUE_DEVICES:
        spec = specs[name]
        assert set(spec.sources) == {"peak_tflops", "bandwidth", "memory", "launch_overhead"}
        assert all(len(text) > 10 for text in spec.sources.values())
    assert "cpu-local" in device_names()


def test_h100_sxm_numbers_are_the_dense_datasheet_figures():
    h100 = device("h100-sxm")
    assert h100.bandwidth_bytes_per_s == 3.35e12
    assert h100.peak_flops[PeakClass.BF16] == pytest.approx(989.4e12)  # not the 1,979 sparse figure
    assert h100.peak_flops[PeakClass.FP8] == pytest.approx(1978.9e12)
    assert h100.memory_bytes == 80 * 10**9
    assert h100.matrix_peak("bf16") == h100.peak_flops[PeakClass.BF16]


def test_a_chip_without_fp8_units_has_no_fp8_peak():
    assert device("a100-80gb").matrix_peak("f8e4m3") is None
    assert device("b200").matrix_peak("f4e2m1") == pytest.approx(9000e12)


def test_unknown_device_names_the_known_ones():
    with pytest.raises(UnknownDeviceError, match="h100-sxm"):
        device("h1000")


GOOD = """
schema = 1
[device.x]
title = "X"
kind = "gpu"
memory_gb = 1
bandwidth_gb_s = 2
launch_overhead_ns = 3
vector_tflops = 4
[device.x.peak_tflops]
bf16 = 5
[device.x.sources]
peak_tflops = "datasheet a"
bandwidth = "datasheet b"
memory = "datasheet c"
launch_overhead = "estimate d"
"""


def test_a_minimal_file_parses_to_si_units():
    specs, probed = parse_devices(GOOD, "devs.toml")
    x = specs["x"]
    assert (x.memory_bytes, x.bandwidth_bytes_per_s, x.launch_overhead_ns, x.vector_flops) == (10**9, 2e9, 3, 4e12)
    assert x.peak_flops == {PeakClass.BF16: 5e12}
    assert probed == []


@pytest.mark.parametrize(
    "edit, key",
    [
        (("bandwidth_gb_s = 2", "bandwidth_gb_s = -2"), "device.x.bandwidth_gb_s"),
        (("bandwidth_gb_s = 2", "bandwidth_gb_s = 0"), "device.x.bandwidth_gb_s"),
        (("bandwidth_gb_s = 2", 'bandwidth_gb_s = "fast"'), "device.x.bandwidth_gb_s"),
        (("bf16 = 5", "bf17 = 5"), "device.x.peak_tflops.bf17"),
        (('memory = "datasheet c"\n', ""), "device.x.sources.memory"),
        (('kind = "gpu"', 'kind = "tpu"'), "device.x.kind"),
        (("vector_tflops = 4", "vector_tflops = 4\nspeed = 1"), "device.x.speed"),
        (("schema = 1", "schema = 2"), "schema"),
    ],
)
def test_malformed_specs_name_file_and_key(edit, key):
    old, new = edit
    with pytest.raises(DeviceSpecError) as raised:
        parse_devices(GOOD.replace(old, new), "devs.toml")
    assert raised.value.file == "devs.toml"
    assert raised.value.key == key
    assert "devs.toml" in str(raised.value) and key in str(raised.value)


CACHED = GOOD.replace("vector_tflops = 4", "vector_tflops = 4\ncache_mb = 50\ncache_bandwidth_gb_s = 12000").replace(
    'launch_overhead = "estimate d"', 'launch_overhead = "estimate d"\ncache = "microbenchmark e"')


def test_a_declared_cache_tier_parses_to_bytes_and_bytes_per_second():
    x = parse_devices(CACHED, "devs.toml")[0]["x"]
    assert (x.cache_bytes, x.cache_bandwidth_bytes_per_s) == (50 * 10**6, 12e12)
    assert x.has_cache_tier() and x.sources["cache"] == "microbenchmark e"


@pytest.mark.parametrize(
    "text, key",
    [
        (CACHED.replace("cache_bandwidth_gb_s = 12000", ""), "device.x.cache_bandwidth_gb_s"),
        (CACHED.replace("cache_mb = 50", ""), "device.x.cache_mb"),
        (CACHED.replace('cache = "microbenchmark e"', ""), "device.x.sources.cache"),
        (CACHED.replace("cache_mb = 50", "cache_mb = 0"), "device.x.cache_mb"),
        (GOOD.replace('launch_overhead = "estimate d"', 'launch_overhead = "estimate d"\ncache = "e"'),
         "device.x.sources.cache"),
    ],
)
def test_a_cache_tier_is_all_or_nothing(text, key):
    with pytest.raises(DeviceSpecError) as raised:
        parse_devices(text, "devs.toml")
    assert raised.value.key == key


def test_shipped_datasheet_devices_have_no_cache_tier_until_a_bandwidth_is_sourced():
    # Vendors publish L2 sizes but no L2 bandwidth; see the note at the top of devices.toml.
    assert [name for name, spec in load_devices().items() if spec.has_cache_tier()] == []


def test_rate_at_rows_interpolates_in_log2_rows_between_measured_points():
    # Why: the probe measures at powers of two; a chunk between two of them (a 48-row verify
    # step, a 100-row prompt) must be priced between their rates, never past either.
    from fuel.cost.spec import rate_at_rows

    points = ((16, 100.0), (64, 300.0), (256, 400.0))
    assert rate_at_rows(points, 16) == 100.0 and rate_at_rows(points, 64) == 300.0
    assert rate_at_rows(points, 32) == pytest.approx(200.0)  # one of the two doublings
    assert rate_at_rows(points, 128) == pytest.approx(350.0)
    assert rate_at_rows(points, 4) == 100.0  # below the smallest: its rate, not extrapolated
    assert rate_at_rows(points, 2048) == 400.0  # past the largest: the rate levels off
    assert rate_at_rows(reversed(points), 32) == pytest.approx(200.0)  # order does not matter


def test_rate_at_rows_ignores_unusable_points_and_has_no_rate_without_any():
    from fuel.cost.spec import rate_at_rows

    assert rate_at_rows(((16, 0.0), (64, float("nan")), (256, 400.0)), 32) == 400.0
    assert rate_at_rows((), 32) is None and rate_at_rows(((16, -1.0),), 16) is None


def test_a_gemm_is_priced_at_the_rate_measured_at_its_rows():
    # Why: a CPU GEMM of 128 rows ran at ~0.8 of the 256-row peak here; pricing every GEMM at
    # the peak predicted prompt chunks ~25% too fast.
    from dataclasses import replace

    from fuel.cost import PeakClass

    spec = replace(device("h100-sxm"),
                   peak_flops={PeakClass.FP32: 200.0},
                   gemv_flops={PeakClass.FP32: 10.0},
                   gemm_rows_flops={PeakClass.FP32: ((16, 40.0), (256, 160.0))})
    assert spec.matrix_peak("f32", rows=1) == 10.0
    assert spec.matrix_peak("f32", rows=4) == pytest.approx(25.0)  # between 1 row and 16
    assert spec.matrix_peak("f32", rows=64) == pytest.approx(100.0)
    assert spec.matrix_peak("f32", rows=256) == 160.0
    assert spec.matrix_peak("f32", rows=0) == 200.0  # rows unknown: the dense peak
    assert device("h100-sxm").matrix_peak("bf16", rows=64) == device("h100-sxm").peak_flops[PeakClass.BF16]
