"""How many ways a step's execute and update enter each kvserve module (issue 65's measure).

Runs the tiny test model through content-reuse repairs of every strategy (their KV moved in, probed,
selected, finished) beside plain prefills and decodes, traces every Python call made inside
`StepExecute.run` and `StepUpdate.apply`, and counts, per kvserve module, the distinct call edges
into it from another module (caller line -> callee function; property reads and dunder methods left
aside). A module entered from five places is
five things a reader of the step must follow into it; re-entry by a loop over items counts once. The
last column counts only the edges from another package (kvserve.reuse.connector -> kvserve.reuse.repair
is a component's own business; kvserve.scheduler.registration -> kvserve.reuse.repair is not).

    python scripts/step_reentry.py            # table of the modules entered more than once
    python scripts/step_reentry.py --all      # every module
"""

from __future__ import annotations

import argparse
import functools
import sys
from collections import defaultdict
from pathlib import Path
from types import CodeType, FrameType
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kvserve import LLM, SamplingParams  # noqa: E402
from kvserve.request import ReuseOptions  # noqa: E402

CHUNK = 32
STRATEGIES = [
    ReuseOptions(reuse="any", recompute_strategy="cacheblend", recompute_ratio=0.3, blend_check_layer=0),
    ReuseOptions(reuse="any", recompute_strategy="query", recompute_ratio=0.3, blend_check_layer=0),
    ReuseOptions(reuse="any", recompute_strategy="selective", recompute_tokens=4),
]


def accessors() -> set[CodeType]:
    """The code of every property getter in kvserve's loaded modules: reading a field is not entering
    a module's logic."""
    found: set[CodeType] = set()
    for name, module in list(sys.modules.items()):
        if not name.startswith("kvserve.") or module is None:
            continue
        for cls in vars(module).values():
            if not isinstance(cls, type) or cls.__module__ != name:
                continue
            for attr in vars(cls).values():
                getter = attr.fget if isinstance(attr, property) else getattr(attr, "func", None)
                if isinstance(attr, (property, functools.cached_property)) and getter is not None:
                    found.add(getter.__code__)
    return found


class Edges:
    """Distinct (caller module:line, callee module:function) edges that cross a module boundary,
    leaving aside property reads and dunder methods (constructors, comparisons)."""

    def __init__(self) -> None:
        self.into: dict[str, set[tuple[str, str]]] = defaultdict(set)
        self.from_outside: dict[str, set[tuple[str, str]]] = defaultdict(set)  # from another package
        self.skip: set[CodeType] = set()

    def profile(self, frame: FrameType, event: str, arg: Any) -> None:
        if event != "call" or frame.f_code in self.skip or frame.f_code.co_name.startswith("__"):
            return
        callee = frame.f_globals.get("__name__", "")
        caller_frame = frame.f_back
        if not callee.startswith("kvserve.") or caller_frame is None:
            return
        caller = caller_frame.f_globals.get("__name__", "")
        if caller == callee or not caller.startswith("kvserve."):
            return  # within a module, or from outside kvserve (torch calling back)
        site = f"{caller}:{caller_frame.f_lineno}"
        self.into[callee].add((site, frame.f_code.co_qualname))
        if package(caller) != package(callee):
            self.from_outside[callee].add((site, frame.f_code.co_qualname))


def package(module: str) -> str:
    """kvserve.reuse.repair -> kvserve.reuse; a module directly in kvserve is its own package."""
    return ".".join(module.split(".")[:2])


def traced(obj: Any, name: str, edges: Edges) -> None:
    method = getattr(obj, name)

    def wrapper(*args: Any, **kwargs: Any) -> Any:
        sys.setprofile(edges.profile)
        try:
            return method(*args, **kwargs)
        finally:
            sys.setprofile(None)

    setattr(obj, name, wrapper)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument(
        "--all", action="store_true", help="list every module entered, not only those entered twice or more"
    )
    ap.add_argument("--show", default="", help="comma-separated modules whose edges to list")
    args = ap.parse_args()
    llm = LLM(
        model="tiny-random-llama",
        chunk_size=CHUNK,
        pieces="fixed",
        reuse_min_saving=-10.0,
        max_cache_bytes=50_000_000,
    )
    engine = llm.engine
    walks = {"StepExecute.run": Edges(), "StepUpdate.apply": Edges()}
    skip = accessors()
    for edges in walks.values():
        edges.skip = skip
    traced(engine.execute, "run", walks["StepExecute.run"])
    traced(engine.update, "apply", walks["StepUpdate.apply"])
    tok = llm.engine.tokenizer
    docs = [
        tok.encode(f"Document {i}: " + " ".join(f"word{i}x{j}" for j in range(60)))[: 3 * CHUNK]
        for i in range(3)
    ]
    for d in docs:
        llm.warm(d)
    system = tok.encode("You answer from the documents below. " * 16)[: 2 * CHUNK]
    question = tok.encode(" Which word comes first?")
    params = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
    served = []
    llm.generate([system + question], params)  # the cost model's first observation: plans follow
    for i, opts in enumerate(STRATEGIES):
        order = [(i + 1 + k) % 3 for k in range(3)]
        prompt = system + [t for k in order for t in docs[k]] + question
        plain = system[: -1 - i] + question  # a plain prefill and decode beside the repair
        outs = llm.generate([prompt, plain], params, reuse=opts)
        served.append(
            (opts.recompute_strategy, outs[0].num_approx_cached_tokens, outs[0].num_recomputed_tokens)
        )
    for strategy, reused, recomputed in served:
        print(f"# {strategy}: {reused} tokens reused approximately, {recomputed} recomputed")
    assert all(reused > 0 for _, reused, _ in served), (
        "a strategy served no content match: nothing was measured"
    )
    print("| walk | module | from other modules | from other packages |")
    print("|---|---|---|---|")
    for walk, edges in walks.items():
        for module, into in sorted(edges.into.items(), key=lambda kv: (-len(kv[1]), kv[0])):
            if len(into) > 1 or args.all:
                print(f"| {walk} | {module} | {len(into)} | {len(edges.from_outside.get(module, ()))} |")
        for module in filter(None, args.show.split(",")):
            for site, callee in sorted(edges.into.get(module, ())):
                print(f"#   {walk}: {site} -> {module}.{callee}")
        worst = max((len(v) for v in edges.into.values()), default=0)
        outside = max((len(v) for v in edges.from_outside.values()), default=0)
        print(f"| {walk} | (most) | {worst} | {outside} |")


if __name__ == "__main__":
    main()
