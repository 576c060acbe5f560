"""StepThreads: a step list's thread count follows its own step times (the pool's, or one thread
while another process stalls the pool), and a step list's results do not depend on it."""

from __future__ import annotations

import pytest

from fuel.kernels.threads import StepThreads


def drive(chooser: StepThreads, seconds, steps: int, key="decode") -> list[int]:
    """Run ``steps`` steps of program ``key`` whose time is ``seconds(threads)``; the counts
    taken, in order."""
    taken = []
    for _ in range(steps):
        threads = chooser.threads()
        taken.append(threads)
        chooser.record(key, threads, seconds(threads))
    return taken


def quiet(threads: int) -> float:
    return 0.007 if threads == 2 else 0.012  # the pool is faster


def stalled(threads: int) -> float:
    return 0.050 if threads == 2 else 0.016  # another process holds a core


def test_a_quiet_pool_is_kept_and_one_thread_is_probed_ever_less_often():
    chooser = StepThreads(2, probe_every=8, probe_steps=2, max_interval=32)
    taken = drive(chooser, quiet, 200)
    assert chooser.current == 2 and not chooser.switches
    probes = [i for i, (a, b) in enumerate(zip([2] + taken, taken)) if a == 2 and b == 1]
    gaps = [b - a for a, b in zip(probes, probes[1:])]
    assert gaps == sorted(gaps) and gaps[-1] >= 32  # the interval doubles up to its cap
    assert taken.count(1) <= 2 * (len(probes))  # probe_steps each


def test_a_stalled_pool_gives_way_to_one_thread_at_once_and_is_taken_back_when_it_ends():
    chooser = StepThreads(2, probe_every=8, probe_steps=2, max_interval=32)
    drive(chooser, quiet, 20)
    assert chooser.current == 2
    # a process takes a core: two slow steps in a row trigger a probe (not the next interval)
    taken = drive(chooser, stalled, 5)
    assert taken == [2, 2, 1, 1, 1] and chooser.current == 1
    assert chooser.switches[-1][1] == 1
    taken = drive(chooser, stalled, 100)
    assert chooser.current == 1 and taken.count(2) < 15  # the pool probed, not taken
    # the process ends: a probe finds the pool faster again
    drive(chooser, quiet, 40)
    assert chooser.current == 2 and chooser.switches[-1][1] == 2


def test_a_pool_of_one_never_probes():
    chooser = StepThreads(1)
    assert set(drive(chooser, stalled, 50)) == {1} and not chooser.switches


@pytest.mark.parametrize("pool", [2, 4])
def test_a_first_step_or_a_single_slow_step_does_not_trigger_a_probe(pool):
    chooser = StepThreads(pool, probe_every=100, window=5)
    # a program's first steps (a cold cache) are not judged against a window not yet full
    assert drive(chooser, lambda n: 0.05 if chooser.steps < 2 else 0.007, 10) == [pool] * 10
    # one slow step among quick ones is a blip
    assert drive(chooser, lambda n: 0.05 if chooser.steps == 12 else 0.007, 20) == [pool] * 20
    assert chooser.current == pool and not chooser.switches


def test_a_stall_found_by_one_program_moves_every_program_and_each_compares_only_itself():
    # Why: a stall is the machine's: the next context bucket's program must not start over on
    # the stalled pool; but two programs' step times differ, so a probe is judged within one.
    chooser = StepThreads(2, probe_every=8, probe_steps=2, max_interval=32)
    drive(chooser, quiet, 20, key="bucket 64")
    drive(chooser, stalled, 5, key="bucket 64")
    assert chooser.current == 1
    # a new program, four times slower a step than the first on either count
    taken = drive(chooser, lambda n: 4 * stalled(n), 6, key="bucket 128")
    assert taken == [1] * 6  # not the pool again


def test_a_probe_on_a_program_with_no_figure_keeps_the_choice_and_asks_again_soon():
    chooser = StepThreads(2, probe_every=4, probe_steps=1, after_switch=3, max_interval=64)
    drive(chooser, quiet, 4, key="a")  # the fourth step starts a probe
    assert chooser.threads() == 1
    chooser.record("b", 1, 0.001)  # the probe's step ran program b, which never ran on the pool
    assert chooser.current == 2 and not chooser.switches
    assert drive(chooser, quiet, 3, key="a") == [2, 2, 2] and chooser.threads() == 1
