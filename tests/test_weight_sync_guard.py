"""The weight-sync guard (``--drpo.verify_weight_sync``) against syncs broken on purpose, through
``python -m drpo_openrlhf.train`` with real vLLM CPU engines (``test_e2e_pipeline.train``).

The breakage lives only in the tests: ``tests/sync_break_site`` on ``PYTHONPATH`` replaces the
CPU worker's ``update_weight`` when ``DRPO_TEST_SYNC_BREAK`` names a breakage per engine
(``sync_breakage.py``). The module's runs join one Ray cluster whose workers inherit both;
each run's breakages are in the file that variable names, written before the run.
Every breakage must stop the run with the guard's message; with the guard off, the same
breakages run to the end (exit 0), so it is the guard that stops them. Engines that hold the
right weights but compute otherwise are the weight probe's (``--drpo.weight_probe``); its
control is in the same run: the healthy engines beside them are not named, and the healthy
engines of every other run here pass their probes.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from test_e2e_pipeline import train
from test_weight_places_guard import BROKEN, PLACES, another_checkpoint, break_site_cluster

from drpo_openrlhf.eval.tensorboard_logs import read_scalars
from drpo_openrlhf.sync.logprob_gap import FALLBACK_LIMIT, HONEST_CAP, derived_limit

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

SKIPPED = "model.layers.0.self_attn.o_proj.weight"
RENAMED = ("model.layers.0.mlp.down_proj.weight", "model.layers.1.mlp.down_proj.weight")
# engine 0: one tensor skipped, one loaded under the wrong name; engine 1 loads nothing;
# engine 2: the right values in other places (test_weight_places_guard.py's PLACES)
ONE_STEP_BREAKS = {
    "0": {"skip": SKIPPED, "rename": RENAMED},
    "1": {"nothing": True},
    "2": PLACES["0"],
}
GUARD = "weight sync check failed"
HOLDS = r"holds other values or places than the actor's '([^']+)'"


@pytest.fixture(scope="module")
def break_file(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("sync_break") / "breaks.json"


@pytest.fixture(scope="module")
def ray_address(break_file):
    """One cluster for the module, with fake GPUs for the actor and up to four engines."""
    with break_site_cluster(break_file, num_gpus=5) as address:
        yield address


@pytest.fixture
def broken_run(toy, ray_address, break_file):
    """``broken_run(out, breaks, *flags, steps=...)``: a run on the toy whose engines are broken
    as ``breaks`` says (engine index -> breakage, ``sync_breakage.py``)."""

    def run(out: Path, breaks: dict, *flags: str, steps: int):
        break_file.write_text(json.dumps(breaks))
        try:
            return train(toy, out, *flags, ray_address=ray_address, steps=steps)
        finally:
            break_file.write_text("{}")

    return run


def engine_reports(out: str, engines: int) -> list[str]:
    """The guard's problems per engine: the lines under its ``engine i of n:`` headings."""
    reports: list[list[str]] = [[] for _ in range(engines)]
    current = None
    for line in out.splitlines():
        head = re.fullmatch(rf"  engine (\d+) of {engines}:", line)
        if head:
            current = int(head[1])
        elif current is not None and line.startswith("    "):
            reports[current].append(line)
        else:
            current = None
    return ["\n".join(lines) for lines in reports]


def test_skipped_renamed_unloaded_and_misplaced_tensors_stop_the_run_at_the_first_sync(
    broken_run, tmp_path
):
    """Every breakage of the first sync, one run, three engines (``ONE_STEP_BREAKS``): engine 0
    skips a tensor and loads another under the wrong name, engine 1 loads nothing, engine 2
    loads the right values in other places (``PLACES``: rows reversed, a square matrix
    transposed, gate and up swapped). None masks another: the check (``check_sync``) lists
    every engine's problems under its own ``engine i of 3:`` before it raises, and an engine's
    problems depend on its own report only. Engines 0 and 1 fail the per-name load checks,
    which end their own check before the digests (``engine_problems``), so no "holds other
    values" line comes from them; engine 2 loads every name exactly once, so its problems are
    the digests' only. At most 8 problems are listed per engine; engine 0 has 5, engine 2 4."""
    done = broken_run(tmp_path, ONE_STEP_BREAKS, "--vllm.num_engines", "3", steps=2)
    assert done.returncode != 0
    out = done.output
    assert f"{GUARD} after rollout step 1" in out, out[-3000:]
    engine0, engine1, engine2 = engine_reports(out, 3)
    assert f"'{SKIPPED}' was sent but not loaded" in engine0, engine0
    assert f"vLLM parameter '{SKIPPED}' was not loaded by this sync" in engine0
    assert f"'{RENAMED[1]}' was loaded 2 times" in engine0
    assert f"'{RENAMED[0]}' was sent but not loaded" in engine0
    assert "was sent but not loaded" in engine1 and "and " in engine1  # every tensor, cut
    named = set(re.findall(HOLDS, engine2))
    assert named == set(BROKEN), engine2
    assert set(re.findall(HOLDS, out)) == set(BROKEN)  # from engine 2 only
    assert "vLLM parameter 'model.layers.1.mlp.gate_up_proj.weight' holds" in engine2
    assert "not loaded" not in engine2 and "times" not in engine2, engine2
    assert "Global step 2:" not in out


def test_an_engine_one_sync_behind_stops_the_run(broken_run, tmp_path):
    done = broken_run(tmp_path, {"0": {"lag": True}}, steps=2)
    assert done.returncode != 0
    out = done.output
    assert "of the sync before loaded" in out  # the first sync was whole, the second lagged
    for when in ("before the first rollout", "after rollout step 1"):  # checks passed, probed
        assert f"drpo_openrlhf: weight probe {when}: |vLLM - actor| log-prob" in out, when
    assert "drpo_openrlhf: honest rollout log-prob gap" in out  # step 1, weights checked
    assert f"{GUARD} after rollout step 2" in out, out[-3000:]
    assert "engine 0 of 1:" in out and "holds other values or places than the actor's" in out


# engines 2 and 3 hold the actor's weights but compute otherwise (sync_breakage.py); 0 and 1 do not
COMPUTE_BREAKS = {"2": {"rope_theta": 4.0}, "3": {"fp16_linear": True}}
PROBE_FAILED = "weight probe before the first rollout failed (--drpo.weight_probe all)"


def test_engines_that_compute_otherwise_stop_the_run_at_the_first_probe(broken_run, tmp_path):
    """What the digests cannot see, four engines, one run: engine 2's rotary base is 4x the
    model's, engine 3's linear layers compute in fp16. The settings check names engine 2's
    base at start-up; allowed here (``--drpo.allow_engine_difference rope_theta``), the run
    goes on, so the probe is tried on both. Their weights are exact, so the check before the
    first rollout passes; the probe, scored by each engine before the first request, names
    both against the two healthy engines (which agree bit for bit), and engine 2 against the
    actor too (over the cap at the first probe); engine 3's gap to the actor stays within the
    honest gap's range, which only the engines' comparison can tell apart."""
    done = broken_run(
        tmp_path,
        COMPUTE_BREAKS,
        *("--vllm.num_engines", "4", "--drpo.allow_engine_difference", "rope_theta"),
        steps=1,
    )
    assert done.returncode != 0
    out = done.output
    assert "SYNC BREAK: rotary base x 4.0" in out and "compute in fp16" in out
    allowed = re.findall(
        r"  allowed: engine (\d) of 4: rope_theta ([\d.]+), the actor's ([\d.]+)", out
    )
    assert [(e, float(ours) / float(theirs)) for e, ours, theirs in allowed] == [("2", 4.0)], out
    assert GUARD not in out  # the weights are the actor's
    assert PROBE_FAILED in out, out[-3000:]
    print(out[out.index(PROBE_FAILED) :][:1500])
    named = re.findall(r"engine (\d+) scores the probe differently from engines 0, 1:", out)
    assert sorted(named) == ["2", "3"], out[-3000:]
    far = re.findall(r"engine (\d+) is [\d.e-]+ nats per token from the actor", out)
    assert far == ["2"], out[-3000:]
    assert "Global step 1:" not in out


SETTINGS_FAILED = "the vLLM engines do not run the model as the actor does (at start-up)"
# engine 1 of two created otherwise than the run asks (sync_breakage.py); engine 0 healthy
# engine 1 otherwise in three settings; engine 0 agrees with it on the shorter context, so
# only the comparison with the actor can name engine 0 for it
SETTINGS_BREAKS = {
    "0": {"max_model_len": 96},
    "1": {"dtype": "float16", "rope_theta": 2.0, "max_model_len": 96},
}


def settings_named(out: str) -> dict[tuple[str, str], tuple[str, str]]:
    """(engine, setting) -> (its value, the actor's), from the settings check's stop."""
    lines = re.findall(r"  engine (\d+) of \d+: (\w+) (.+), the actor's (.+)", out)
    return {(engine, name): (ours, theirs) for engine, name, ours, theirs in lines}


def test_an_engine_created_otherwise_than_the_actor_stops_the_run_at_start_up(broken_run, tmp_path):
    """Engine 1 of two in fp16, with a rotary base 2x the model's and a shorter context, and
    engine 0 with the same shorter context only: the settings check names each with both
    values before the weights are compared (fp16 weights would fail the digests too, naming
    the wrong cause) and before any rollout. Engine 0 is named for its context alone, which
    only the comparison with the actor sees (the engines agree on it); its dtype and rotary
    base, right, are not (the only engine broken:
    ``test_the_only_engine_created_otherwise_stops_the_run``). The control is every other run
    here and in test_e2e_pipeline.py, whose healthy engines pass the same check (its line is
    asserted in the resumed run of test_e2e_pipeline.py)."""
    done = broken_run(tmp_path, SETTINGS_BREAKS, "--vllm.num_engines", "2", steps=1)
    assert done.returncode != 0
    out = done.output
    assert "SYNC BREAK: the engine's model in float16" in out
    assert "EngineSettingsError" in out and SETTINGS_FAILED in out, out[-3000:]
    print(out[out.index(SETTINGS_FAILED) :][:1500])
    named = settings_named(out)
    assert set(named) == {
        ("1", "dtype"),
        ("1", "rope_theta"),
        ("1", "max_model_len"),
        ("0", "max_model_len"),
    }, named
    assert named["1", "dtype"][0] == "float16"
    assert named["1", "dtype"][1] in ("bfloat16", "float32")  # the CPU's dtype (docs/cpu.md)
    ours, theirs = named["1", "rope_theta"]
    assert float(ours) == 2 * float(theirs)
    assert named["1", "max_model_len"] == named["0", "max_model_len"] == ("96", "128")
    assert "--drpo.allow_engine_difference dtype,max_model_len,rope_theta" in out
    assert GUARD not in out and "weight probe" not in out and "Global step 1:" not in out


# engine 1 samples (and reports its log-probs) at temperature 1.0 where the actor scores at 0.6
TEMPERATURE_BREAK = {"1": {"temperature": 1.0}}
# the gap's stop at the first rollout: over the cap of an honest gap, or over 10x engine 0's
GAP_FAILED = r"rollout step 1(, the run's first \(|: vLLM's rollout log-probs differ).*"


def test_an_engine_sampling_at_another_temperature_stops_the_run_at_its_first_rollout(
    broken_run, tmp_path
):
    """What neither the digests nor the probe can see: engine 1 of two samples at temperature
    1.0 while the run (and so the actor's scoring) is at 0.6. Its weights are exact and prompt
    log-probs skip every sampling setting, so the check and the probe pass and the two engines'
    probes agree; the rollout log-prob gap, per engine, names engine 1 at the first rollout
    (measured by hand: 0.113 nats per token, over the 0.1 cap of an honest first rollout and
    far over 10x engine 0's honest gap), before any update. Engine 0, beside it, is not named;
    the control, every guarded run that exits 0 (``test_e2e_pipeline.py``), holds each engine
    under the same limit. Without the guard (``--drpo.max_logprob_gap 100``) this run trains
    through (run by hand: exit 0)."""
    done = broken_run(
        tmp_path,
        TEMPERATURE_BREAK,
        *("--vllm.num_engines", "2", "--rollout.temperature", "0.6"),
        steps=1,
    )
    assert done.returncode != 0
    out = done.output
    assert "SYNC BREAK: sampling at temperature 1.0 instead of 0.6" in out, out[-3000:]
    assert GUARD not in out and "WeightProbeError" not in out  # weights and probe: fine
    assert "drpo_openrlhf: weight probe before the first rollout:" in out
    assert "LogprobGapError" in out, out[-3000:]
    stop = re.search(GAP_FAILED, out)
    assert stop, out[-3000:]
    stop = stop[0]
    print(stop[:1500])
    named = re.findall(r"engine (\d+) ([\d.e-]+) \(max [\d.e-]+\)", stop)
    assert [engine for engine, _ in named] == ["1"], stop
    assert float(named[0][1]) > HONEST_CAP / 2, stop  # far from an honest gap, whichever limit
    assert "Global step 1:" not in out


def test_without_the_guard_the_same_breakages_run_through(broken_run, toy, tmp_path):
    """The control: every breakage above and in ``test_weight_places_guard.py`` at once, guard
    off, the log-prob limit out of the way: the run ends normally, so it is the guard that
    stops them. The stale policy's ``drpo/rollout_logprob_gap`` crosses the limit a guarded
    run derives from its first rollout by step 3 (measured here: 0.0013, 0.04-0.08, 0.11;
    docs/cpu.md), and the CPU fallback limit too, so the second signal would too."""
    other = another_checkpoint(toy, tmp_path / "other")
    breaks = {
        "0": {**ONE_STEP_BREAKS["0"], **PLACES["0"], "lag": True},
        "1": {"nothing": True, "start_from": str(other)},
    }
    done = broken_run(
        tmp_path / "run",
        breaks,
        *("--vllm.num_engines", "2", "--no-drpo.verify_weight_sync"),
        *("--drpo.max_logprob_gap", "100"),
        steps=3,
    )
    assert done.returncode == 0, done.output[-3000:]
    breaks_seen = [line for line in done.output.splitlines() if "SYNC BREAK:" in line]
    for marker in (
        "not loaded",
        "loaded as",
        "of the sync before loaded",
        "rows reversed",
        "transposed",
        "first weights loaded from",
    ):
        assert any(marker in line for line in breaks_seen), marker
    assert GUARD not in done.output
    logged = read_scalars(tmp_path / "run" / "tb")
    gaps = logged["train/drpo/rollout_logprob_gap"]
    print("stale-policy rollout_logprob_gap per step:", gaps)
    assert sorted(gaps) == [1, 2, 3]
    per_engine = [logged[f"train/drpo/rollout_logprob_gap/engine_{i}"] for i in (0, 1)]
    print("per engine:", per_engine)
    for step in (1, 2, 3):  # both engines generated every rollout; the pooled mean lies between
        low, high = sorted(engine[step] for engine in per_engine)
        assert low * (1 - 1e-6) <= gaps[step] <= high * (1 + 1e-6), (step, low, high)
    # each engine's gap is its own: after the first sync engine 0 holds tensors skipped,
    # renamed and in other places (nats off: 1.5 measured), engine 1 a stale policy (one
    # step's change: 0.06 measured)
    assert per_engine[0][2] > 0.5 > per_engine[1][2], per_engine
    assert derived_limit(gaps[1]) < max(gaps[2], gaps[3])
    assert gaps[1] < FALLBACK_LIMIT < max(gaps[2], gaps[3])


def test_the_only_engine_created_otherwise_stops_the_run(broken_run, tmp_path):
    """Engine 1's three settings broken in a run's only engine: nothing to compare it with
    but the actor, which is enough."""
    done = broken_run(tmp_path, {"0": SETTINGS_BREAKS["1"]}, steps=1)
    assert done.returncode != 0
    assert SETTINGS_FAILED in done.output, done.output[-3000:]
    named = settings_named(done.output)
    assert set(named) == {("0", "dtype"), ("0", "rope_theta"), ("0", "max_model_len")}, named
    assert named["0", "max_model_len"] == ("96", "128")
    assert "Global step 1:" not in done.output
