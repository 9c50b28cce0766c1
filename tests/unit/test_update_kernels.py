"""The update kernels (installed C, chunked CPU torch, accelerator torch) against a float64
reference."""

from __future__ import annotations

import math
import os
from collections.abc import Iterator, Sequence
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from deadweight.callbacks.update import native as update_native
from deadweight.callbacks.update.device import DeviceKernel
from deadweight.callbacks.update.probe import UpdateProbe
from deadweight.callbacks.update.stats import PendingStats, TensorGroup, UpdateStats

NATIVE = update_native.load() is not None
PATHS = ["torch", "native"]  # the install (pip install -e . in .ci/run) builds the kernel


def reference(old: list[torch.Tensor], new: list[torch.Tensor]) -> dict[str, float]:
    """The figures computed naively in float64, with bytes for the exact test."""
    upd = par = 0.0
    unchanged = nonfinite = same_elements = 0
    for a, b in zip(old, new, strict=True):
        width = a.element_size()
        bytes_a = a.contiguous().view(torch.uint8).view(-1, width)
        bytes_b = b.contiguous().view(torch.uint8).view(-1, width)
        same_elements += int((bytes_a == bytes_b).all(dim=1).sum())
        a64, b64 = a.double(), b.double()
        d = b64 - a64
        if not bool(torch.isfinite(d).all()):
            nonfinite += 1
            continue
        upd += float(d.square().sum())
        par += float(b64.square().sum())
        same = a.contiguous().view(torch.uint8).equal(b.contiguous().view(torch.uint8))
        unchanged += int(same)
    return {"upd": upd, "par": par, "unchanged": unchanged, "nonfinite": nonfinite,
            "same": same_elements}


def check(stats: UpdateStats, ref: dict[str, float]) -> None:
    assert stats.unchanged_tensors == ref["unchanged"]
    assert stats.nonfinite_update_tensors == ref["nonfinite"]
    assert stats.unchanged_elements == ref["same"]
    assert math.isclose(stats.update_sq_sum, ref["upd"], rel_tol=1e-2, abs_tol=1e-30)
    if ref["nonfinite"] == 0:
        assert math.isclose(stats.param_sq_sum, ref["par"], rel_tol=1e-2, abs_tol=1e-30)


def step(probe: UpdateProbe, tensors: list[torch.Tensor], delta: list[torch.Tensor]) -> UpdateStats:
    """before_step, an in-place optimizer-like update, after_step."""
    probe.before_step()
    with torch.no_grad():
        torch._foreach_add_(tensors, delta)
    stats = probe.after_step()
    assert stats is not None
    return stats


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
def test_matches_reference_over_consecutive_steps(path: str, dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(1)
    shapes = [(16, 64), (128, 16), (0,), (7,), (3, 5, 2), (1,)]
    tensors = [torch.randn(s, generator=gen).to(dtype) for s in shapes]
    probe = UpdateProbe(tensors, path=path)  # type: ignore[arg-type]
    assert probe.path == path
    for k in range(3):
        old = [t.clone() for t in tensors]
        delta = [torch.randn(t.shape, generator=gen).to(dtype) * 1e-2 for t in tensors]
        delta[1].zero_()  # a tensor the step leaves alone
        if k == 2:
            delta = [d.zero_() for d in delta]  # a frozen step
        stats = step(probe, tensors, delta)
        check(stats, reference(old, tensors))
        assert stats.watched_tensors == len(shapes)
        assert stats.sampled is False


@pytest.mark.parametrize("path", PATHS)
def test_a_one_ulp_change_underflowing_the_square_is_not_unchanged(path: str) -> None:
    tiny = torch.full((1000,), 1e-30)
    normal = torch.ones(10)
    probe = UpdateProbe([tiny, normal], path=path)  # type: ignore[arg-type]
    probe.before_step()
    tiny[500] = torch.nextafter(tiny[500], torch.tensor(1.0))  # d ~ 1e-37, d^2 underflows
    stats = probe.after_step()
    assert stats is not None
    assert stats.unchanged_tensors == 1  # only `normal`
    assert stats.update_sq_sum < 1e-60


@pytest.mark.parametrize("path", PATHS)
def test_cpu_kernels_compare_bytes_so_a_sign_of_zero_flip_counts(path: str) -> None:
    t = torch.zeros(8)
    probe = UpdateProbe([t], path=path)  # type: ignore[arg-type]
    probe.before_step()
    t[3] = -0.0
    stats = probe.after_step()
    assert stats is not None and stats.unchanged_tensors == 0 and stats.update_sq_sum == 0.0


@pytest.mark.parametrize("path", PATHS)
def test_nonfinite_updates_are_counted_and_kept_out_of_the_sums(path: str) -> None:
    a, b, c = torch.ones(100), torch.ones(50, dtype=torch.bfloat16), torch.ones(10)
    probe = UpdateProbe([a, b, c], path=path)  # type: ignore[arg-type]
    probe.before_step()
    a[7] = float("nan")
    b[3] = float("inf")
    c += 0.5
    stats = probe.after_step()
    assert stats is not None
    assert stats.nonfinite_update_tensors == 2
    assert stats.unchanged_tensors == 0
    assert stats.update_sq_sum == pytest.approx(10 * 0.25)


@pytest.mark.parametrize("path", PATHS)
def test_a_write_between_steps_is_not_counted_in_the_next_step(path: str) -> None:
    t = torch.zeros(64)
    probe = UpdateProbe([t], path=path)  # type: ignore[arg-type]
    step(probe, [t], [torch.full((64,), 1.0)])
    with torch.no_grad():
        t.add_(5.0)  # e.g. a callback editing weights: bumps the version counter
    stats = step(probe, [t], [torch.zeros(64)])
    assert stats.unchanged_tensors == 1 and stats.update_sq_sum == 0.0


@pytest.mark.parametrize("path", PATHS)
def test_steady_state_skips_the_pre_step_copy(path: str) -> None:
    t = torch.zeros(64)
    probe = UpdateProbe([t], path=path)  # type: ignore[arg-type]
    step(probe, [t], [torch.ones(64)])
    probe._snapshot[0].fill_(123.0)  # were before_step to copy, this would be overwritten
    probe.before_step()
    assert float(probe._snapshot[0][0]) == 123.0


@pytest.mark.parametrize("path", PATHS)
def test_parameters_and_groups(path: str) -> None:
    model = torch.nn.Sequential(torch.nn.Linear(8, 4), torch.nn.Linear(4, 2))
    params = list(model.parameters())
    groups = [TensorGroup("first", "module", [0, 1]), TensorGroup("second", "module", [2, 3])]
    probe = UpdateProbe(params, groups, path=path)  # type: ignore[arg-type]
    opt = torch.optim.SGD(params[2:], lr=0.1)
    model(torch.ones(3, 8)).sum().backward()
    probe.before_step()
    opt.step()
    stats = probe.after_step()
    assert stats is not None
    first, second = stats.groups
    assert (first.tensors, first.unchanged_tensors, first.update_sq_sum) == (2, 2, 0.0)
    assert (second.tensors, second.unchanged_tensors) == (2, 0)
    assert second.update_sq_sum == pytest.approx(stats.update_sq_sum)


@pytest.mark.parametrize("path", PATHS)
def test_sampled_mode_bounds_the_snapshot(path: str) -> None:
    big = [torch.randn(256, 512), torch.randn(300_001), torch.randn(10)]
    probe = UpdateProbe(big, max_full_elements=1000, sample_per_tensor=256,
                        path=path)  # type: ignore[arg-type]
    assert probe.sampled
    copies = 2 if path == "torch" else 1  # the CPU torch kernel double-buffers
    assert probe.snapshot_bytes <= copies * (3 * 256 * 4 + 3 * 64)
    before = [t.clone() for t in big]
    stats = step(probe, big, [torch.full_like(t, 0.25) for t in big])
    assert stats.sampled and stats.watched_params == sum(t.numel() for t in before)
    assert stats.update_sq_sum == pytest.approx((256 + 256 + 10) * 0.0625)
    assert stats.unchanged_tensors == 0


def test_auto_takes_the_native_kernel_on_cpu_when_it_builds() -> None:
    probe = UpdateProbe([torch.zeros(4)])
    assert NATIVE, "no native kernel: build it with pip install -e . (needs a C compiler)"
    assert probe.path == "native"
    half = UpdateProbe([torch.zeros(4, dtype=torch.float16)])
    assert half.path == "torch"  # no native float16 loop: the torch kernel covers it


@pytest.fixture
def fresh_native() -> Iterator[None]:
    update_native.reset()
    yield
    update_native.reset()


def test_an_install_without_the_kernel_uses_the_torch_kernel(
    fresh_native: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(update_native, "MODULE", "deadweight.callbacks._no_such_kernel")
    assert update_native.load() is None
    probe = UpdateProbe([torch.zeros(4)])
    assert probe.path == "torch"
    assert "carries no native kernel" in probe.describe()


def test_native_can_be_switched_off(fresh_native: None, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DEADWEIGHT_NATIVE", "0")
    assert update_native.load() is None
    assert "DEADWEIGHT_NATIVE=0" in update_native.describe()
    with pytest.raises(RuntimeError):
        UpdateProbe([torch.zeros(4)], path="native")


def test_the_kernel_is_the_installed_extension_and_nothing_is_compiled(
    fresh_native: None, tmp_path: Path
) -> None:
    # A fresh process with no compiler reachable and an empty cache folder still loads the
    # kernel: it is the file the build backend put into the package.
    import subprocess
    import sys

    path = update_native.library_path()
    assert path is not None
    assert Path(path).parent.resolve() == Path(update_native.__file__).parent.resolve()
    code = (
        "import torch\n"
        "from deadweight.callbacks.update.probe import UpdateProbe\n"
        "t = torch.zeros(3)\n"
        "p = UpdateProbe([t], path='native')\n"
        "p.before_step(); t.add_(1.0)\n"
        "print(p.after_step().update_sq_sum)\n"
    )
    env = {**os.environ, "XDG_CACHE_HOME": str(tmp_path), "HOME": str(tmp_path),
           "CC": "/bin/false", "PATH": str(tmp_path)}
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          env=env, timeout=120, check=False)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "3.0"
    assert list(tmp_path.iterdir()) == []  # nothing built, nothing cached


floats = st.floats(min_value=-1e3, max_value=1e3, allow_nan=False, width=32)


@settings(max_examples=40, deadline=None)
@given(
    data=st.lists(st.lists(floats, min_size=0, max_size=40), min_size=1, max_size=5),
    moves=st.lists(st.booleans(), min_size=5, max_size=5),
    dtype=st.sampled_from([torch.float32, torch.bfloat16]),
)
def test_kernels_agree(data: list[list[float]], moves: list[bool], dtype: torch.dtype) -> None:
    results = []
    for path in ["torch", "native"]:
        tensors = [torch.tensor(row, dtype=torch.float32).to(dtype) for row in data]
        probe = UpdateProbe(tensors, path=path)  # type: ignore[arg-type]
        old = [t.clone() for t in tensors]
        delta = [torch.full_like(t, 0.5 if moves[i] else 0.0) for i, t in enumerate(tensors)]
        stats = step(probe, tensors, delta)
        ref = reference(old, tensors)
        check(stats, ref)
        results.append((stats.unchanged_tensors, stats.nonfinite_update_tensors))
    assert len(set(results)) == 1


def accelerator_probe(tensors: list[torch.Tensor],
                      groups: Sequence[TensorGroup] = ()) -> UpdateProbe:
    """A probe running the accelerator (CUDA) code path of the torch kernel, here on CPU."""
    probe = UpdateProbe(tensors, groups, path="torch")
    probe._kernel = DeviceKernel(probe._sources)
    return probe


def test_accelerator_path_matches_reference_with_mixed_dtypes() -> None:
    gen = torch.Generator().manual_seed(3)
    tensors = [torch.randn(40, 8, generator=gen), torch.randn(64, generator=gen).bfloat16(),
               torch.randn(5, generator=gen), torch.zeros(9, dtype=torch.bfloat16)]
    probe = accelerator_probe(tensors)
    for frozen in (False, True):
        old = [t.clone() for t in tensors]
        scale = 0.0 if frozen else 1e-2
        delta = [torch.randn(t.shape, generator=gen).to(t.dtype) * scale for t in tensors]
        delta[3].zero_()
        check(step(probe, tensors, delta), reference(old, tensors))


def test_accelerator_path_sees_a_change_whose_square_underflows() -> None:
    tiny = torch.full((100,), 1e-30)
    probe = accelerator_probe([tiny])
    probe.before_step()
    tiny[5] = torch.nextafter(tiny[5], torch.tensor(1.0))
    stats = probe.after_step()
    assert stats is not None and stats.unchanged_tensors == 0


@pytest.mark.parametrize("path", PATHS)
def test_mixed_dtypes_in_one_probe(path: str) -> None:
    tensors = [torch.ones(10), torch.ones(10, dtype=torch.bfloat16), torch.ones(3).double()]
    probe = UpdateProbe(tensors, path=path)  # type: ignore[arg-type]
    stats = step(probe, tensors, [torch.full_like(t, 0.5) for t in tensors])
    # the CPU torch fallback returns 16-bit norms in 16 bits: three significant digits
    assert stats.update_sq_sum == pytest.approx(23 * 0.25, rel=1e-2)
    assert stats.param_sq_sum == pytest.approx(23 * 2.25, rel=1e-2)


@pytest.mark.parametrize("path", PATHS)
def test_replaced_storage_is_followed(path: str) -> None:
    param = torch.nn.Parameter(torch.zeros(32))
    probe = UpdateProbe([param], path=path)  # type: ignore[arg-type]
    step(probe, [param], [torch.ones(32)])
    param.data = torch.full((32,), 7.0)  # e.g. a device move: new storage, old one orphaned
    probe.before_step()
    with torch.no_grad():
        param.add_(1.0)
    stats = probe.after_step()
    assert stats is not None
    assert stats.unchanged_tensors == 0 and stats.update_sq_sum == pytest.approx(32.0)


@pytest.mark.parametrize("path", PATHS)
def test_sample_is_evenly_spaced_runs_from_first_to_last(path: str) -> None:
    t = torch.zeros(100_000)
    probe = UpdateProbe([t], max_full_elements=1000, sample_per_tensor=500,
                        path=path)  # type: ignore[arg-type]
    (source,) = probe._sources
    assert source.shape == (50, 10) and source.stride() == (2040, 1)  # (100000 - 10) // 49
    seen = []
    for index in (0, 99_965, 5_000):  # first run, last run, between runs
        probe.before_step()
        t[index] += 1.0
        stats = probe.after_step()
        assert stats is not None
        seen.append(stats.unchanged_tensors == 0)
    assert seen == [True, True, False]


@pytest.mark.parametrize("path", [*PATHS, "accelerator"])
def test_partial_freeze_by_precision_is_counted_per_element_and_per_group(path: str) -> None:
    # bf16 weights near 1.0 with updates of 1e-3 (a bf16 ULP there is 2**-7): about half the
    # elements get an update too small to change their bytes. The tensor-level test sees every
    # tensor change; the element counts see what did not move, per group, with its dtype.
    gen = torch.Generator().manual_seed(5)
    lora_a = (1.0 + 0.01 * torch.randn(64, 32, generator=gen)).bfloat16()
    lora_b = torch.randn(32, 64, generator=gen)  # float32: every element moves
    groups = [TensorGroup("lora_A", "module", [0]), TensorGroup("lora_B", "module", [1])]
    tensors = [lora_a, lora_b]
    if path == "accelerator":
        probe = accelerator_probe(tensors, groups)
    else:
        probe = UpdateProbe(tensors, groups, path=path)  # type: ignore[arg-type]
    old = [t.clone() for t in tensors]
    scale = torch.where(torch.rand(64, 32, generator=gen) < 0.5, 1e-3, 3e-2)
    stats = step(probe, tensors, [(scale * torch.sign(torch.randn(64, 32, generator=gen)))
                                  .bfloat16(), torch.full((32, 64), 0.25)])
    ref = reference(old, tensors)
    assert stats.unchanged_tensors == 0
    assert stats.unchanged_elements == ref["same"]
    by_name = {g.name: g for g in stats.groups}
    a, b = by_name["lora_A"], by_name["lora_B"]
    assert (a.elements, a.dtype, b.elements, b.dtype) == (2048, "bfloat16", 2048, "float32")
    assert b.unchanged_elements == 0
    assert 0.3 * 2048 < a.unchanged_elements == ref["same"] < 0.7 * 2048


@pytest.mark.parametrize("path", [*PATHS, "accelerator"])
def test_a_deferred_read_keeps_its_own_step(path: str) -> None:
    # The callback reads a step's figures later, from the sender thread, after the training
    # thread has run the next step: each pending result must still hold its own step.
    t = torch.zeros(100)
    probe = (accelerator_probe([t]) if path == "accelerator"
             else UpdateProbe([t], path=path))  # type: ignore[arg-type]
    pending = []
    for delta in (1.0, 0.0, 2.0):
        probe.before_step()
        with torch.no_grad():
            t[:10] += delta
        result = probe.after_step_deferred()
        assert isinstance(result, PendingStats)
        pending.append(result)
    stats = [p.result() for p in pending]
    assert [s.update_sq_sum for s in stats] == pytest.approx([10.0, 0.0, 40.0])
    assert [s.unchanged_elements for s in stats] == [90, 100, 90]
    assert [s.unchanged_tensors for s in stats] == [0, 1, 0]
    assert pending[0].result() is stats[0]  # read once, kept


def test_one_log_line_says_which_kernel_runs(
    fresh_native: None, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    import logging

    with caplog.at_level(logging.INFO, logger="deadweight"):
        UpdateProbe([torch.zeros(4)])
    (line,) = [r for r in caplog.records if "update pass runs" in r.getMessage()]
    assert "native (installed C kernel" in line.getMessage() and line.levelno == logging.INFO
    caplog.clear()
    monkeypatch.setenv("DEADWEIGHT_NATIVE", "0")
    update_native.reset()
    with caplog.at_level(logging.INFO, logger="deadweight"):
        UpdateProbe([torch.zeros(4)])
    (line,) = [r for r in caplog.records if "update pass runs" in r.getMessage()]
    assert "torch (DEADWEIGHT_NATIVE=0)" in line.getMessage()
    assert line.levelno == logging.WARNING  # the slow fallback is worth seeing


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64])
def test_long_tensors_cut_into_rows_and_strided_ones_are_counted_exactly(
    dtype: torch.dtype,
) -> None:
    # The CPU torch kernel cuts a tensor longer than a row into rows (plus a shorter last one)
    # and lays tensors of one length out as a block; a transposed (non-contiguous) tensor is
    # copied whole. Every element count must still be exact, against the bytes.
    from deadweight.callbacks.update.chunked import MAX_ROW

    gen = torch.Generator().manual_seed(7)
    tensors = [torch.randn(2 * MAX_ROW + 13, generator=gen).to(dtype),
               torch.randn(64, 48, generator=gen).to(dtype).t(),
               torch.randn(64, 48, generator=gen).to(dtype),
               torch.randn(MAX_ROW, generator=gen).to(dtype)]
    probe = UpdateProbe(tensors, path="torch")
    for moved in (1, 1000, 0):
        old = [t.clone() for t in tensors]
        delta = []
        for t in tensors:
            d = torch.zeros(t.numel(), dtype=dtype)
            d[torch.randperm(t.numel(), generator=gen)[:moved]] = 0.5
            delta.append(d.view(t.shape))
        stats = step(probe, tensors, delta)
        check(stats, reference(old, tensors))


@pytest.mark.parametrize("path", PATHS)
def test_unchanged_elements_of_a_nonfinite_tensor_are_its_equal_bytes(path: str) -> None:
    t = torch.ones(40, dtype=torch.bfloat16)
    probe = UpdateProbe([t], path=path)  # type: ignore[arg-type]
    probe.before_step()
    t[:4] = float("inf")
    t[4:10] += 1.0
    stats = probe.after_step()
    assert stats is not None
    assert (stats.nonfinite_update_tensors, stats.unchanged_tensors) == (1, 0)
    assert stats.unchanged_elements == 30
