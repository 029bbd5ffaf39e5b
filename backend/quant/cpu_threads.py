"""How many threads the CPU decode step uses: one or all of torch's, chosen by timing both.

A decode step of a small model is ~150 dependent pieces of work of a few to a few hundred
microseconds each, so a second thread pays a hand-off at every one of them. On a quiet
machine that is cheap and the projections split well; on a busy one (other processes, other
engines, a laptop doing other things) a helper thread is regularly descheduled while the
step waits on it, and two threads measured 2x slower than one on a shared 2-core VM. Which
case holds changes at run time, so the step measures instead of guessing: a trial alternates
the two counts for a few steps, the faster median wins for the next `EXPLOIT_STEPS` steps,
then a new trial. The count never changes a result (cpu_layer.c splits the work in the
same blocks either way), only the time.
"""

from __future__ import annotations

import statistics

__all__ = ["ThreadChoice"]


class ThreadChoice:
    """`threads(cap)` before each step, `record(threads, seconds)` after it."""

    TRIAL_STEPS = 8  # per trial, alternating one thread and `cap` threads
    EXPLOIT_STEPS = 256  # steps on the winner before the next trial

    def __init__(self) -> None:
        self._cap = 0  # the thread budget the current state was decided for
        self._trial: dict[int, list[float]] = {}
        self._trial_left = 0
        self._choice = 1
        self._exploit_left = 0

    @property
    def choice(self) -> int:
        """The count the last trial chose (1 before any)."""
        return self._choice

    def threads(self, cap: int) -> int:
        if cap <= 1:
            return 1
        if cap != self._cap:  # a new budget (torch.set_num_threads): decide again
            self._cap, self._exploit_left, self._trial_left = cap, 0, 0
        if self._exploit_left > 0:
            self._exploit_left -= 1
            return self._choice
        if self._trial_left == 0:  # start a trial
            self._trial = {1: [], cap: []}
            self._trial_left = self.TRIAL_STEPS
        return 1 if self._trial_left % 2 == 0 else cap

    def record(self, threads: int, seconds: float) -> None:
        if self._trial_left == 0 or threads not in self._trial or self._exploit_left > 0:
            return
        self._trial[threads].append(seconds)
        self._trial_left -= 1
        if self._trial_left == 0:
            medians = {n: statistics.median(times) for n, times in self._trial.items() if times}
            self._choice = min(medians, key=lambda n: (medians[n], n))
            self._exploit_left = self.EXPLOIT_STEPS
