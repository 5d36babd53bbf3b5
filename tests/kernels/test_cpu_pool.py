"""The CPU extension's own worker threads (csrc/cpu/parallel.h): every kernel computes the same bits
on them as through at::parallel_for, at any thread count (the pool serves threads other than the
main one, and every thread under OMP_WAIT_POLICY=PASSIVE); a forked child gets a pool of its own."""

from __future__ import annotations

import contextlib
import multiprocessing
import threading

import pytest
import torch


@contextlib.contextmanager
def pool(ext, on: bool, threads: int):
    before_pool, before_threads = ext.set_pool(on), torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        yield
    finally:
        ext.set_pool(before_pool)
        torch.set_num_threads(before_threads)


def inputs(ext) -> dict:
    """A linear in fp32 and bf16, the gated MLP and attention over a paged bf16 pool: each kernel family
    that splits its work over threads, large enough to use every thread."""
    gen = torch.Generator().manual_seed(0)
    x, w = torch.randn(70, 576, generator=gen), torch.randn(1536, 576, generator=gen)
    xb, wb = x.bfloat16(), w.bfloat16()
    n, bs = 300, 16
    nb = (n + bs - 1) // bs
    return {
        "x": x, "xb": xb, "w": ext.pack_linear_weight(w), "wb": ext.pack_linear_weight_bf16(wb),
        "glu": torch.cat([ext.pack_linear_weight_bf16(wb[:768]), ext.pack_linear_weight_bf16(wb[768:])]),
        "q": torch.randn(n, 6, 64, generator=gen).bfloat16(),
        "k": torch.randn(nb, bs, 2, 64, generator=gen).bfloat16(),
        "v": torch.randn(nb, bs, 2, 64, generator=gen).bfloat16(),
        "meta": (
            torch.arange(nb, dtype=torch.int32)[None], torch.tensor([n], dtype=torch.int32),
            torch.tensor([0, n], dtype=torch.int32), torch.arange(n, dtype=torch.int32),
        ),
    }  # fmt: skip


def linears(ext, a: dict) -> list[torch.Tensor]:
    return [
        ext.row_linear(a["x"], a["w"], None, 1536),
        ext.row_linear_bf16(a["xb"], a["wb"], None, 1536),
        ext.row_linear_glu(a["xb"], a["glu"], None, 768),
    ]


def kernels(ext, a: dict | None = None) -> list[torch.Tensor]:
    a = a or inputs(ext)
    return [*linears(ext, a), ext.paged_attention_dense(a["q"], a["k"], a["v"], *a["meta"], 0.125, 0)]


def on_thread(fn):
    result = []
    t = threading.Thread(target=lambda: result.append(fn()))
    t.start()
    t.join()
    return result[0]


@pytest.mark.parametrize("threads", [2, 3])
def test_the_pool_computes_what_parallel_for_does(ext, threads):
    with pool(ext, False, threads):
        want = kernels(ext)
    with pool(ext, True, threads):
        main = kernels(ext)
        other = on_thread(lambda: kernels(ext))  # the server's engine calls from a thread of its own
        again = kernels(ext)  # the pool is still there, and right, after another thread used it
    for w, m, o, a in zip(want, main, other, again):
        assert torch.equal(w, m) and torch.equal(w, o) and torch.equal(w, a)


def _child(queue, ext, args):
    # the linears alone (torch's own OpenMP ops, as attention's output conversion, hang in a forked
    # child), on a thread other than the child's main one, which keeps at::parallel_for
    queue.put([raw(t) for t in on_thread(lambda: linears(ext, args))])


def raw(t: torch.Tensor) -> bytes:
    """t's bytes (a tensor itself would travel as a file descriptor the exiting child closes)."""
    return t.contiguous().view(torch.uint8).numpy().tobytes()


def test_a_forked_child_has_a_pool_of_its_own(ext):
    """The parent's workers do not exist in a child: without a new pool its first call would wait for
    them forever."""
    args = inputs(ext)
    with pool(ext, True, 2):
        want = on_thread(lambda: linears(ext, args))  # the parent's pool exists before the fork
        ctx = multiprocessing.get_context("fork")
        queue = ctx.Queue()
        child = ctx.Process(target=_child, args=(queue, ext, args))
        child.start()
    try:
        got = queue.get(timeout=60)
        child.join(timeout=60)
    finally:
        if child.is_alive():
            child.kill()
    assert child.exitcode == 0
    assert got == [raw(w) for w in want]
