"""Replay quality (format.md §7): agreement between two routings, expert load, and missing
routes (-1 sentinel rows) as data: properties, a hand-computed fixture, hostile input."""

from __future__ import annotations

import importlib
import importlib.util
import json
import re
import shutil
import struct
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import routed_experts as rx


def payload(values: Any, start: int = 0, dtype: str | None = None) -> rx.RoutedExperts:
    return rx.RoutedExperts.from_array(np.asarray(values, dtype=np.int64), start=start, dtype=dtype)


def distinct_rows(rng: np.random.Generator, tokens: int, layers: int, k: int, experts: int) -> Any:
    """Valid routing: k distinct experts per router, in random order."""
    keys = rng.random((tokens, layers, experts))
    return np.argsort(keys, axis=-1)[..., :k]


def reference(a: np.ndarray, b: np.ndarray) -> dict[str, Any]:
    """What a user writes in numpy: sort each row, compare; overlap by counting common ids."""
    sa, sb = np.sort(a, axis=-1), np.sort(b, axis=-1)
    exact = (sa == sb).all(axis=-1)  # (tokens, layers)
    k = a.shape[-1]
    common = np.zeros(a.shape[:2], dtype=np.int64)
    for t in range(a.shape[0]):
        for layer in range(a.shape[1]):
            x, y = list(a[t, layer]), list(b[t, layer])
            for v in x:
                if v in y:
                    y.remove(v)
                    common[t, layer] += 1
    differ = (~exact).sum(axis=1)
    # A layer zero throughout on both sides (top_k > 1) has no router: left out, NaN per layer.
    routed = ~(((a == 0) & (b == 0)).all(axis=(0, 2)) & (k > 1))
    per_exact = np.where(routed, exact.mean(axis=0), np.nan)
    per_overlap = np.where(routed, common.sum(axis=0) / (a.shape[0] * k), np.nan)
    return {
        "exact_match": exact[:, routed].mean() if routed.any() else np.nan,
        "overlap": (common[:, routed].sum() / (common[:, routed].size * k)
                    if routed.any() else np.nan),
        "tokens_with_difference": (differ > 0).mean(),
        "differing_per_token": differ.mean(),
        "exact_match_per_layer": per_exact,
        "overlap_per_layer": per_overlap,
        "no_router_layers": np.flatnonzero(~routed).tolist(),
    }


def assert_matches(r: rx.Agreement, want: dict[str, Any]) -> None:
    for name, value in want.items():
        np.testing.assert_allclose(getattr(r, name), value, rtol=1e-12, err_msg=name)


# --- agreement ---------------------------------------------------------------------------------


def test_the_papers_three_statistics_on_a_fixture_computed_by_hand() -> None:
    # 4 tokens, 3 layers, top_k 2. Changed routers (token, layer): (0, 1) shares one expert,
    # (2, 0) and (2, 2) share none, (3, 1) shares one. 4 of 12 routers differ.
    rollout = [
        [[1, 2], [3, 4], [5, 6]],
        [[1, 3], [2, 4], [6, 7]],
        [[0, 1], [2, 3], [4, 5]],
        [[7, 6], [5, 4], [3, 2]],
    ]
    trainer = [
        [[2, 1], [3, 9], [6, 5]],  # layer 1: {3, 4} vs {3, 9}
        [[3, 1], [4, 2], [7, 6]],  # only the order differs
        [[8, 9], [3, 2], [6, 7]],  # layers 0 and 2 differ entirely
        [[6, 7], [4, 0], [2, 3]],  # layer 1: {5, 4} vs {4, 0}
    ]
    r = rx.agreement(payload(rollout), payload(trainer))
    # The paper's statistics: routers that differ (1 - exact_match), tokens with a difference
    # in at least one layer, routers differing per token.
    assert 1 - r.exact_match == pytest.approx(4 / 12)
    assert r.tokens_with_difference == pytest.approx(3 / 4)
    assert r.differing_per_token == pytest.approx(4 / 4)
    assert r.overlap == pytest.approx((24 - 1 - 2 - 2 - 1) / 24)
    np.testing.assert_allclose(r.exact_match_per_layer, [3 / 4, 2 / 4, 3 / 4])
    np.testing.assert_allclose(r.overlap_per_layer, [6 / 8, 6 / 8, 6 / 8])
    assert (r.compared_rows, r.excluded_rows, r.start, r.stop) == (4, 0, 0, 4)
    assert r.to_dict()["exact_match_per_layer"] == pytest.approx([0.75, 0.5, 0.75])
    assert "exact_match=0.6667" in repr(r)


@settings(max_examples=60, deadline=None)
@given(
    seed=st.integers(0, 2**32 - 1),
    tokens=st.integers(1, 40),
    layers=st.integers(1, 6),
    k=st.integers(1, 8),
    experts=st.sampled_from([16, 256, 384, 70_000]),
    rate=st.floats(0, 1),
)
def test_injected_changes_are_recovered_exactly(
    seed: int, tokens: int, layers: int, k: int, experts: int, rate: float
) -> None:
    rng = np.random.default_rng(seed)
    experts = max(experts, k + 1)
    if experts > 1000:  # ids past the bit masks: the general path
        a = np.stack([[rng.choice(experts, k, replace=False) for _ in range(layers)]
                      for _ in range(tokens)])
    else:
        a = distinct_rows(rng, tokens, layers, k, experts)
    changed = rng.random((tokens, layers)) < rate
    b = a.copy()
    for t, layer in zip(*np.nonzero(changed)):
        row = b[t, layer]
        outside = np.setdiff1d(np.arange(min(experts, 2 * k + 2)), row)
        row[rng.integers(k)] = rng.choice(outside)  # exactly one expert replaced
        rng.shuffle(row)  # order inside a row never matters
    r = rx.agreement(payload(a), payload(b))
    n = tokens * layers
    assert r.exact_match == pytest.approx(1 - changed.sum() / n, abs=1e-12)
    assert r.overlap == pytest.approx(1 - changed.sum() / (n * k), abs=1e-12)
    assert r.tokens_with_difference == pytest.approx(changed.any(axis=1).mean(), abs=1e-12)
    assert r.differing_per_token == pytest.approx(changed.sum() / tokens, abs=1e-12)
    np.testing.assert_allclose(r.exact_match_per_layer, 1 - changed.mean(axis=0), atol=1e-12)


@settings(max_examples=60, deadline=None)
@given(
    seed=st.integers(0, 2**32 - 1),
    shape=st.tuples(st.integers(1, 20), st.integers(1, 5), st.integers(1, 9)),
    high=st.sampled_from([3, 256, 384, 40_000]),
    dtypes=st.tuples(
        st.sampled_from(["uint8", "uint16", "int32", None]),
        st.sampled_from(["uint16", "int32", "int64", None]),
    ),
)
def test_agreement_equals_the_numpy_reference_on_any_ids(
    seed: int, shape: tuple[int, int, int], high: int, dtypes: tuple[str | None, str | None]
) -> None:
    # Any ids (repeats within a row included: they count as often as they appear), any dtype
    # pair, and a routing against itself and against a row-permuted copy.
    rng = np.random.default_rng(seed)
    high = min(high, 255) if "uint8" in dtypes else high
    a = rng.integers(0, high, size=shape)
    b = np.where(rng.random(shape) < 0.3, rng.integers(0, high, size=shape), a)
    pa, pb = payload(a, dtype=dtypes[0]), payload(b, dtype=dtypes[1])
    assert_matches(rx.agreement(pa, pb), reference(a, b))
    assert_matches(rx.agreement(a, b), reference(a, b))  # numpy arrays too
    permuted = rng.permuted(a, axis=-1)
    dense = ((a == 0).all(axis=(0, 2)) & (shape[2] > 1)).tolist()
    for same in (rx.agreement(pa, pa), rx.agreement(pa, payload(permuted))):
        if all(dense):  # every layer zero throughout: no router to compare
            assert np.isnan(same.exact_match) and np.isnan(same.overlap)
        else:
            assert (same.exact_match, same.overlap) == (1.0, 1.0)
        assert (same.tokens_with_difference, same.differing_per_token) == (0.0, 0.0)


def test_payloads_are_aligned_by_absolute_position() -> None:
    rng = np.random.default_rng(1)
    whole = distinct_rows(rng, 30, 4, 8, 64)
    trainer = whole.copy()
    trainer[12, 2] = np.roll(trainer[12, 2], 1)  # same set
    trainer[20, 1, 0] = 64 + 1  # one router differs, id 65
    r = rx.agreement(payload(whole[5:25], start=5), payload(trainer[10:], start=10))
    assert (r.start, r.stop, r.compared_rows) == (10, 25, 15)
    assert r.exact_match == pytest.approx(1 - 1 / (15 * 4))
    with pytest.raises(rx.PayloadError, match=r"share positions, got \[0, 5\) and \[10, 30\)"):
        rx.agreement(payload(whole[:5]), payload(trainer[10:], start=10))


def test_missing_rows_are_excluded_and_counted() -> None:
    a = np.arange(24).reshape(4, 3, 2)
    b = a.copy()
    b[1] = -1  # NeMo-RL's all -1 row: a route that was not recorded
    b[3, 0] = [0, 99]  # differs
    a2 = a.copy()
    a2[2] = -1
    r = rx.agreement(payload(a2), payload(b))
    assert (r.compared_rows, r.excluded_rows) == (2, 2)
    assert r.exact_match == pytest.approx(5 / 6)
    assert r.tokens_with_difference == pytest.approx(1 / 2)
    none_left = rx.agreement(payload(a2[2:3], start=2), payload(a[2:3], start=2))
    assert (none_left.compared_rows, none_left.excluded_rows) == (0, 1)
    assert np.isnan(none_left.exact_match)  # nothing compared: NaN, not a made-up 1.0


class TensorLike:
    """What a CPU torch tensor offers numpy (`__array__`); real torch is used when installed."""

    def __init__(self, a: np.ndarray) -> None:
        self.a = a

    def __array__(self, dtype: Any = None, copy: Any = None) -> np.ndarray:
        return self.a


def test_torch_tensors_are_read_like_arrays() -> None:
    a = np.arange(24).reshape(4, 3, 2)
    b = a.copy()
    b[0, 0] = [1, 0]
    tensors: list[Any] = [TensorLike(a)]
    if importlib.util.find_spec("torch") is not None:
        tensors.append(importlib.import_module("torch").from_numpy(a))
    for t in tensors:
        assert rx.agreement(t, b).exact_match == 1.0
        assert rx.agreement(t, np.roll(a, 1, axis=0)).exact_match == 0.0
        assert rx.expert_load(t, 24).counts.sum() == 24


@pytest.mark.parametrize(
    ("a", "b", "message"),
    [
        (np.zeros((2, 3, 2)), np.zeros((2, 3, 2)), "an integer array"),
        (np.zeros((2, 3, 2), np.int64), np.zeros((2, 4, 2), np.int64), "`num_layers`"),
        (np.zeros((2, 3, 2), np.int64), np.zeros((2, 3, 3), np.int64), "`top_k`"),
        (np.zeros((2, 3, 0), np.int64), np.zeros((2, 3, 0), np.int64), "top_k >= 1"),
        (np.zeros((2, 0, 2), np.int64), np.zeros((2, 0, 2), np.int64), "at least one layer"),
        (np.zeros((0, 3, 2), np.int64), np.zeros((0, 3, 2), np.int64), "share positions"),
        (np.zeros((2, 3), np.int64), np.zeros((2, 3), np.int64), "3 dimensions"),
        ([[[0, -2]]], [[[0, 1]]], r"got -2 at position 0, layer 0"),
        ([[[0, 1]], [[-1, 5]]], [[[0, 1]], [[0, 1]]], r"in a, got -1 at position 1, layer 0"),
    ],
)
def test_hostile_agreement_inputs_are_payload_errors(a: Any, b: Any, message: str) -> None:
    with pytest.raises(rx.PayloadError, match=message):
        rx.agreement(np.asarray(a), np.asarray(b))


# --- expert load -------------------------------------------------------------------------------


def test_expert_load_counts_and_figures_by_hand() -> None:
    # 2 layers, 4 experts, top_k 2; token 1 is missing.
    p = payload([[[0, 1], [2, 3]], [[-1, -1], [-1, -1]], [[0, 2], [2, 3]]])
    load = rx.expert_load(p, num_experts=4)
    assert load.counts.tolist() == [[2, 1, 1, 0], [0, 0, 2, 2]]
    assert load.counts.dtype == np.int64
    assert (load.rows, load.missing_rows, load.num_layers, load.num_experts) == (2, 1, 2, 4)
    np.testing.assert_allclose(load.imbalance, [2.0, 2.0])
    np.testing.assert_allclose(load.cv, [np.std([2, 1, 1, 0]) / 1.0, np.std([0, 0, 2, 2]) / 1.0])
    assert load.never_chosen_per_layer.tolist() == [1, 2]
    assert load.never_chosen.tolist() == []
    assert rx.expert_load(payload([[[0, 1]]]), 5).never_chosen.tolist() == [2, 3, 4]


@settings(max_examples=40, deadline=None)
@given(
    seed=st.integers(0, 2**32 - 1),
    parts=st.lists(st.integers(0, 30), min_size=1, max_size=4),
    layers=st.integers(1, 5),
    k=st.integers(1, 8),
    experts=st.sampled_from([8, 256, 384, 1000]),
)
def test_expert_load_equals_bincount_per_layer(
    seed: int, parts: list[int], layers: int, k: int, experts: int
) -> None:
    rng = np.random.default_rng(seed)
    arrays = [rng.integers(0, experts, size=(n, layers, k)) for n in parts]
    payloads = [payload(a, dtype="int32") for a in arrays]
    whole = np.concatenate(arrays)
    # A layer zero throughout a payload (k > 1) has no router (a dense layer): not counted.
    want = np.zeros((layers, experts), dtype=np.int64)
    for a in arrays:
        for layer in range(layers):
            if k > 1 and len(a) and not a[:, layer].any():
                continue
            want[layer] += np.bincount(a[:, layer].ravel(), minlength=experts)
    load = rx.expert_load(payloads, experts)
    np.testing.assert_array_equal(load.counts, want)
    assert load.rows == whole.shape[0]
    np.testing.assert_array_equal(rx.expert_load(tuple(arrays), experts).counts, want)


@pytest.mark.parametrize(
    ("routing", "num_experts", "message"),
    [
        ([[[0, 4]]], 4, r"ids in 0\.\.4, got 4 at position 0, layer 0"),
        ([[[0, 1]], [[3, -3]]], 4, r"got -3 at position 1, layer 0"),
        ([[[0, 1]]], 0, "`num_experts`: expected at least 1"),
        ([[[0, 1]]], 2**62, "`num_experts`: expected a count table of at most"),
        ([[[0, 1]]], 2**40, "`num_experts`: expected a count table of at most"),
    ],
)
def test_hostile_expert_load_inputs_are_payload_errors(
    routing: Any, num_experts: int, message: str
) -> None:
    with pytest.raises(rx.PayloadError, match=message):
        rx.expert_load(np.asarray(routing), num_experts)


def test_expert_load_refuses_batches_that_disagree() -> None:
    with pytest.raises(rx.PayloadError, match="`num_layers`: expected 1 as in the other"):
        rx.expert_load([payload([[[0, 1]]]), payload([[[0], [1]]])], 4)
    with pytest.raises(rx.PayloadError, match="at least one routing"):
        rx.expert_load([], 4)
    with pytest.raises(rx.PayloadError, match="`num_experts`: expected a non-negative integer"):
        rx.expert_load(payload([[[0, 1]]]), -1)


# --- missing routes as data --------------------------------------------------------------------


def test_validate_reports_sentinel_rows_instead_of_calling_them_out_of_range() -> None:
    p = payload([[[1, 2], [3, 4]], [[-1, -1], [-1, -1]], [[5, 6], [7, 0]]], start=100)
    p.validate(num_experts=8)  # missing routes are data: no error by default
    r = p.validation_report(num_experts=8)
    assert r["ok"] and r["out_of_range"] == 0
    assert (r["missing_rows"], r["first_missing_row"]) == (1, 101)
    with pytest.raises(rx.PayloadError, match="marked missing \\(all -1\\) at position 101"):
        p.validate(missing_rows=True)
    assert not p.validation_report(missing_rows=True)["ok"]
    # A -1 beside real ids is no sentinel: it is an id out of range.
    partial = payload([[[1, 2], [-1, 4]]])
    with pytest.raises(rx.PayloadError, match="got -1 at position 0, layer 1"):
        partial.validate()
    # Unsigned dtypes have no sentinel: 255 is an expert id.
    assert payload([[[255, 255]]], dtype="uint8").validation_report()["missing_rows"] == 0


def test_to_training_mask_marks_padded_and_missing_rows() -> None:
    t = rx.Trajectory()
    t.append(payload([[[1, 2]], [[-1, -1]], [[3, 4]]]))
    arr, mask = t.to_training(4, mask=True)
    assert arr.tolist() == [[[1, 2]], [[-1, -1]], [[3, 4]], [[3, 4]]]
    assert mask.dtype == np.bool_ and mask.tolist() == [True, False, True, False]
    arr, mask = t.to_training(2, mask=True)
    assert mask.tolist() == [True, False] and arr.shape == (2, 1, 2)
    zero, zmask = t.to_training(5, pad="zero", max_missing=2, mask=True)
    assert zmask.tolist() == [True, False, True, False, False]
    assert not isinstance(t.to_training(3), tuple)


# --- the command line, through the console script ----------------------------------------------


def cli(*args: str) -> subprocess.CompletedProcess[str]:
    exe = shutil.which("routed-experts") or str(Path(sys.executable).parent / "routed-experts")
    return subprocess.run([exe, *args], capture_output=True, text=True, timeout=120)


@pytest.fixture
def rollout_and_recompute(tmp_path: Path) -> tuple[str, str]:
    a = np.array([[[1, 2], [3, 4], [5, 6]], [[1, 3], [2, 4], [6, 7]]])
    b = a.copy()
    b[1, 2] = [6, 0]  # one router of six differs, sharing one of two experts
    pa, pb = tmp_path / "rollout.json", tmp_path / "trainer.json"
    pa.write_bytes(payload(a).to_json())
    body = {"choices": [{"index": 0, "routed_experts": payload(b).to_dict()}]}
    pb.write_text(json.dumps(body))  # a response body works as well as a value
    return str(pa), str(pb)


def test_cli_compare_prints_the_agreement_table(rollout_and_recompute: tuple[str, str]) -> None:
    r = cli("compare", *rollout_and_recompute)
    assert r.returncode == 0, r.stderr
    assert "positions compared: [0, 2), 2 rows (0 excluded" in r.stdout
    assert "exact match:            0.8333" in r.stdout
    assert "overlap:                0.9167" in r.stdout
    assert "tokens with difference: 0.5000" in r.stdout
    assert "differing per token:    0.500 of 3 layers" in r.stdout
    assert re.search(r"^\s+2\s+0\.5000\s+0\.7500$", r.stdout, re.M), r.stdout


def test_cli_inspect_stats_prints_the_load_table(rollout_and_recompute: tuple[str, str]) -> None:
    r = cli("inspect", rollout_and_recompute[0], "--stats", "--num-experts", "8")
    assert r.returncode == 0, r.stderr
    assert "expert load: 2 rows, 3 layers, 8 experts (0 rows marked missing" in r.stdout
    # layer 0 picks 1, 2, 1, 3 of 8 experts: max 2 over mean 0.5 = 4.
    assert re.search(r"^\s+0\s+4\.000\s+\S+\s+5$", r.stdout, re.M), r.stdout
    assert "experts no layer chose: 1 [0]" in r.stdout  # the ids are 1..7 of 0..7
    bad = cli("inspect", rollout_and_recompute[0], "--stats", "--num-experts", "5")
    assert bad.returncode == 2
    assert "PayloadError: expected expert ids in 0..5, got 5 at position 0, layer 2" in bad.stderr


@pytest.mark.slow_under_emulation  # 36 s under qemu: matplotlib; none of our compiled code
def test_cli_plot_draws_load_and_agreement(
    rollout_and_recompute: tuple[str, str], tmp_path: Path
) -> None:
    out = tmp_path / "quality.png"
    r = cli("plot", *rollout_and_recompute, "-o", str(out), "--num-experts", "8")
    assert r.returncode == 0, r.stderr
    assert f"wrote {out}" in r.stdout
    image = out.read_bytes()
    assert image[:8] == b"\x89PNG\r\n\x1a\n"
    width, height = struct.unpack(">II", image[16:24])
    one = tmp_path / "load.png"
    assert cli("plot", rollout_and_recompute[0], "-o", str(one)).returncode == 0
    w1, h1 = struct.unpack(">II", one.read_bytes()[16:24])
    assert width == w1 and height > 1.8 * h1  # two panels, one panel


def test_cli_plot_refuses_an_output_it_would_not_write_as_named(
    rollout_and_recompute: tuple[str, str], tmp_path: Path
) -> None:
    # Checked before anything is read or drawn: no traceback, nothing written elsewhere.
    tmp_path = tmp_path / "plots"
    tmp_path.mkdir()
    for output, said in [
        (tmp_path / "x.txt", "the suffix .txt; the suffix says the format: .png, .pdf, .svg"),
        (tmp_path / "noext", "no suffix; the suffix says the format: .png, .pdf, .svg"),
        (tmp_path, "a folder; name the file to write (.png, .pdf, .svg)"),
        (tmp_path / "nowhere" / "a.png", f"the folder {tmp_path / 'nowhere'} does not exist"),
    ]:
        r = cli("plot", rollout_and_recompute[0], "-o", str(output))
        assert r.returncode == 2 and f"-o {output}: {said}" in r.stderr, r.stderr
        assert "Traceback" not in r.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == []


def test_cli_plot_without_matplotlib_says_what_to_install(tmp_path: Path) -> None:
    code = (
        "import sys; sys.modules['matplotlib'] = None\n"  # as if the extra were not installed
        "from routed_experts.cli import main\n"
        f"sys.exit(main(['plot', {str(tmp_path / 'x.json')!r}, '-o', 'x.png']))"
    )
    (tmp_path / "x.json").write_bytes(payload([[[1, 2]]]).to_json())
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert r.returncode == 2
    assert "routed-experts plot needs the plot extra: pip install matplotlib" in r.stderr


def test_zero_rows_false_accepts_all_zero_rows_that_the_default_refuses() -> None:
    # An all-zero row is what a decode server sends for prompt rows it did not compute; a
    # caller that knows its rows may be zero (a padded batch) turns the check off.
    z = rx.RoutedExperts.from_array(np.zeros((3, 1, 2), dtype=np.int64), num_experts=128)
    with pytest.raises(rx.PayloadError, match="got an all-zero row at position 0 \\(3 in all"):
        z.validate()
    z.validate(zero_rows=False)
    report = z.validation_report(zero_rows=False)
    assert report["ok"] is True and report["zero_rows"] == 0
    assert z.validation_report()["zero_rows"] == 3


def _report_reference(
    arr: np.ndarray, start: int, num_experts: int | None, duplicates: bool, zero_rows: bool,
    missing_rows: bool,
) -> dict[str, Any]:
    """format.md §7's checks by hand: ids counted out of range one by one (negative, or past
    num_experts), a router (token x layer) with an expert twice unless its layer is all zero,
    rows all zero, rows all -1 (missing: left out of the other checks, always counted)."""
    out: list[tuple[int, int, int]] = []
    dup: list[tuple[int, int, int]] = []
    zero: list[int] = []
    missing: list[int] = []
    signed = np.issubdtype(arr.dtype, np.signedinteger)
    for i, row in enumerate(arr.astype(np.int64)):
        pos = start + i
        if signed and row.size and (row == -1).all():
            missing.append(pos)
            continue
        if row.size and (row == 0).all():
            if zero_rows:
                zero.append(pos)
        for layer, ids in enumerate(row):
            for v in ids:
                if v < 0 or (num_experts is not None and v >= num_experts):
                    out.append((pos, layer, int(v)))
            if duplicates and (ids != 0).any():
                seen: set[int] = set()
                for v in ids:
                    if int(v) in seen:
                        dup.append((pos, layer, int(v)))
                        break
                    seen.add(int(v))
    ok = not out and not dup and not zero and not (missing_rows and missing)
    return {
        "ok": ok, "out_of_range": len(out), "first_out_of_range": out[0] if out else None,
        "duplicates": len(dup), "first_duplicate": dup[0] if dup else None,
        "zero_rows": len(zero), "first_zero_row": zero[0] if zero else None,
        "missing_rows": len(missing), "first_missing_row": missing[0] if missing else None,
    }


@settings(max_examples=400, deadline=None)
@given(data=st.data())
def test_the_validation_report_counts_what_format_md_says(data: st.DataObject) -> None:
    dtype = data.draw(st.sampled_from(["uint8", "int16", "int32"]))
    tokens, layers, top_k = (data.draw(st.integers(0, 6)), data.draw(st.integers(1, 3)),
                             data.draw(st.integers(1, 3)))
    low = -1 if dtype != "uint8" else 0
    arr = np.array(
        data.draw(st.lists(st.integers(low, 9), min_size=tokens * layers * top_k,
                           max_size=tokens * layers * top_k)),
        dtype=dtype,
    ).reshape(tokens, layers, top_k)
    for i in data.draw(st.lists(st.integers(0, max(tokens - 1, 0)), max_size=2)):
        if tokens:  # whole rows of zeros, or of -1, as engines write them
            arr[i] = data.draw(st.sampled_from([0, low]))
    start = data.draw(st.integers(0, 100))
    p = rx.RoutedExperts.from_array(arr, start=start, dtype=dtype)
    flags = {
        "num_experts": data.draw(st.sampled_from([None, 4, 8, 128])),
        "duplicates": data.draw(st.booleans()),
        "zero_rows": data.draw(st.booleans()),
        "missing_rows": data.draw(st.booleans()),
    }
    want = _report_reference(arr, start, **flags)
    assert p.validation_report(**flags) == want
    if want["ok"]:
        p.validate(**flags)
    else:
        with pytest.raises(rx.PayloadError):
            p.validate(**flags)
