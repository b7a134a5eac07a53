"""Verdict rules: how a row's target is checked against the measurements.

A rule is a callable from the measurements to a ``Check``. Most rows compare one number
with a limit (``Threshold``); the single-stream and 8-stream rows compare afmd's rate
with the others' (``RatioInTurns``), preferring the rounds taken in turns to the separate
phases, which ran minutes apart; time to first token has a rule of its own.
"""

from __future__ import annotations

import operator
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from bench.results import Measurements, Pick, med

Verdict = Callable[[Measurements], "Check"]
OTHERS = {"mlx": "mlx_lm_server", "raw": "raw"}  # label in the check → system


@dataclass(frozen=True)
class Check:
    """A row's verdict (``None``: report only, or not measured) and what it was made of."""

    passed: bool | None = None
    detail: str | None = None  # the verdict column's text; absent when None
    figures: dict[str, Any] = field(default_factory=dict)  # the numbers it compared

    def to_json(self) -> dict[str, Any]:
        out = {"pass": self.passed, **self.figures}
        if self.detail is not None:
            out["detail"] = self.detail
        return out


def no_verdict(res: Measurements) -> Check:
    return Check()


def afmd(pick: Pick) -> Callable[[Measurements], float | None]:
    """afmd's median of ``pick`` (the number most targets are about)."""
    return lambda res: med(pick(res.afmd))


@dataclass(frozen=True)
class Threshold:
    """Passes when ``number`` is at most / at least ``limit``.

    ``figures`` are shown beside the verdict whatever the number; ``detail`` (given the
    number) is the verdict column's text, empty while there is no number; a rule without
    ``detail`` has no detail at all, as in the earlier results.
    """

    number: Callable[[Measurements], float | None]
    compare: str  # "<=" or ">="
    limit: float
    figures: Callable[[Measurements], dict[str, Any]] | None = None
    detail: Callable[[Measurements, float], str] | None = None

    def __call__(self, res: Measurements) -> Check:
        v = self.number(res)
        op = operator.le if self.compare == "<=" else operator.ge
        text = None
        if self.detail is not None:
            text = "" if v is None else self.detail(res, v)
        return Check(None if v is None else op(v, self.limit), text,
                     self.figures(res) if self.figures else {})


@dataclass(frozen=True)
class RatioInTurns:
    """afmd's rate ≥ ``bounds[label]`` × each other's (labels: "mlx", "raw").

    The ratio is afmd's median per-round ratio from the rounds taken in turns
    (``in_turns[label]``) when there is one, else the ratio of the separate phases'
    medians of ``rate``. ``also`` names others shown in the separate phases' text only.
    """

    rate: Pick
    bounds: Mapping[str, float]
    in_turns: Mapping[str, Pick]
    also: tuple[str, ...] = ()

    def __call__(self, res: Measurements) -> Check:
        a = med(self.rate(res.afmd))

        def separate(label: str) -> float | None:
            return ratio(a, med(self.rate(res[OTHERS[label]])))

        turns = {k: med(pick(res.afmd)) for k, pick in self.in_turns.items()}
        sep = {k: separate(k) for k in self.bounds}
        vs = {k: turns[k] if turns[k] is not None else sep[k] for k in self.bounds}
        ok = None if None in vs.values() else all(
            v >= self.bounds[k] for k, v in vs.items() if v is not None)
        shown = {**sep, **{k: separate(k) for k in self.also}}
        detail = paired_detail(join(*(x(v, k) for k, v in vs.items())),
                               join(*(x(v, k) for k, v in shown.items())),
                               turns[next(iter(self.bounds))] is not None)
        return Check(ok, detail, {**{f"afmd_vs_{k}": v for k, v in vs.items()},
                                  "separate_phases": {f"afmd_vs_{k}": v
                                                      for k, v in sep.items()}})


@dataclass(frozen=True)
class NotJudged:
    """``rule``'s numbers and text, with no verdict: too little was measured to judge.

    The quick run's soak is warm-up only; a pass or fail there would say nothing about the
    target, so it is shown (``would_pass``) and left out of the verdicts.
    """

    rule: Verdict
    why: str

    def __call__(self, res: Measurements) -> Check:
        check = self.rule(res)
        detail = f"not judged ({self.why})" + (f": {check.detail}" if check.detail else "")
        return Check(None, detail, {**check.figures, "judged": False,
                                    "would_pass": check.passed})


@dataclass(frozen=True)
class Reported:
    """No target (a "report" row): the verdict column's text and the numbers behind it."""

    detail: Callable[[Measurements], str]
    figures: Callable[[Measurements], dict[str, Any]] | None = None

    def __call__(self, res: Measurements) -> Check:
        return Check(None, self.detail(res), self.figures(res) if self.figures else {})


def ttft(res: Measurements) -> Check:
    """afmd ≤ raw + 3 ms and < mlx_lm.server.

    A few milliseconds are compared, and noise on a shared machine comes in bursts: the
    verdict uses per-round differences from the rounds taken in turns, else afmd's phase
    with a raw sample after each request (``RawSampler``), else the separate phases.
    """
    a, m, r = (med(res[s].ttft.ms) for s in ("afmd", "mlx_lm_server", "raw"))
    turn_raw = med(res.afmd.paired.ttft_minus_raw_ms)
    turn_mlx = med(res.afmd.paired.ttft_minus_mlx_ms)
    diff = med(res.afmd.ttft.paired_diff_ms)
    paired_raw = med(res.afmd.ttft.paired_raw_ms)
    if diff is None and a is not None and r is not None:
        diff = a - r
    vs_mlx = None if a is None or m is None else a - m
    in_turns = turn_raw is not None and turn_mlx is not None
    d_raw, d_mlx = (turn_raw, turn_mlx) if in_turns else (diff, vs_mlx)
    ok = None if d_raw is None or d_mlx is None else (d_raw <= 3.0 and d_mlx < 0)
    detail = ""
    if d_raw is not None and d_mlx is not None:
        detail = f"afmd − raw = {d_raw:+.1f} ms, afmd − mlx = {d_mlx:+.1f} ms"
        if in_turns:
            detail = "in turns " + detail + " (afmd's phase: afmd − raw = " + (
                f"{diff:+.1f} ms" if diff is not None else "n/a") + (
                f" against raw {paired_raw:.1f} ms sampled between its requests"
                if paired_raw is not None else "") + ")"
    return Check(ok, detail, {"afmd_minus_raw_ms": d_raw, "afmd_minus_mlx_ms": d_mlx})


def ratios_detail(pick: Pick) -> Verdict:
    """No target: the detail shows afmd's ratio to mlx_lm.server and to raw."""
    def rule(res: Measurements) -> Check:
        a = med(pick(res.afmd))
        return Check(None, join(*(x(ratio(a, med(pick(res[s]))), k)
                                  for k, s in OTHERS.items())))
    return rule


# -- text --------------------------------------------------------------------------------


def ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def x(v: float | None, what: str) -> str:
    return f"{v:.2f}× {what}" if v is not None else ""


def join(*parts: str) -> str:
    return ", ".join(p for p in parts if p)


def paired_detail(verdict: str, separate: str, paired: bool) -> str:
    if not paired:
        return separate
    return f"in turns {verdict}" + (f" (separate phases: {separate})" if separate else "")


def num(v: float | None, fmt: str = ".0f", suffix: str = "") -> str:
    return "?" if v is None else f"{v:{fmt}}{suffix}"
