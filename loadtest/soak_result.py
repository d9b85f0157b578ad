"""The verdict of a soak run (loadtest/soak.py): what it counted and the checks that decide PASS.

PASS needs: no unexpected error, no output differing from its reference, the KV cache back to
zero with nothing running or waiting, RSS growth after warm-up (peak over the rest of the run vs
peak during warm-up, loadtest.server_proc's definition) under ``rss_limit`` when measured, and at
least one completed request.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class SoakResult:
    duration_s: float = 0.0
    requests: int = 0
    completed: int = 0
    disconnected: int = 0  # hung up on purpose by the client
    tokens: int = 0
    errors: list[str] = field(default_factory=list)
    mismatches: list[str] = field(default_factory=list)
    end_stats: dict = field(default_factory=dict)
    rss_warm_mib: float = float("nan")
    rss_peak_mib: float = float("nan")
    rss_limit: float = 0.05

    @property
    def rss_growth(self) -> float:
        return self.rss_peak_mib / self.rss_warm_mib - 1

    @property
    def kv_clean(self) -> bool:
        s = self.end_stats
        return (
            bool(s)
            and s.get("kv_used_tokens") == 0
            and s.get("running") == 0
            and s.get("waiting") == 0
            and s.get("kv_free_slots") == s.get("kv_slots")
        )

    @property
    def rss_ok(self) -> bool:
        return (
            self.rss_warm_mib != self.rss_warm_mib or self.rss_growth < self.rss_limit
        )  # nan: not measured

    @property
    def ok(self) -> bool:
        return (
            not self.errors
            and not self.mismatches
            and self.kv_clean
            and self.rss_ok
            and self.completed > 0
        )

    def summary(self) -> str:
        rss = (
            "not measured"
            if self.rss_warm_mib != self.rss_warm_mib
            else f"{self.rss_warm_mib:.0f} MiB after warm-up -> peak {self.rss_peak_mib:.0f} MiB "
            f"({self.rss_growth:+.1%}, limit {self.rss_limit:.0%})"
        )
        lines = [
            (
                f"soak: {self.duration_s:.0f} s, {self.requests} requests: {self.completed} "
                f"completed, {self.disconnected} disconnected on purpose; {self.tokens} streamed "
                "events"
            ),
            f"  unexpected errors: {len(self.errors)}",
            f"  outputs differing from the reference: {len(self.mismatches)}",
            f"  at the end: {self.end_stats} -> KV cache "
            + ("clean" if self.kv_clean else "NOT clean"),
            f"  server RSS: {rss}",
            f"  {'PASS' if self.ok else 'FAIL'}",
        ]
        lines += [f"  error: {e}" for e in self.errors[:10]]
        lines += [f"  mismatch: {m}" for m in self.mismatches[:10]]
        return "\n".join(lines)
