"""The Tokenizer is called from three threads (engine: detokenize; server tokenizer thread: encode and
chat templates; event loop: token strings): every call into the HF tokenizer holds one lock (issue 32)."""

from __future__ import annotations

import threading
import time

from kvserve.models.loader import resolve_model_path
from kvserve.tokenizer import IncrementalDetokenizer, Tokenizer


class Spy:
    """Stands in for the HF tokenizer: counts callers inside it at once (sleeping inside, so that an
    unlocked second thread would get in)."""

    def __init__(self, hf):
        self.hf, self.inside, self.most, self.guard = hf, 0, 0, threading.Lock()

    def __getattr__(self, name):
        real = getattr(self.hf, name)
        if not callable(real):
            return real

        def call(*args, **kwargs):
            with self.guard:
                self.inside += 1
                self.most = max(self.most, self.inside)
            try:
                time.sleep(0.001)
                return real(*args, **kwargs)
            finally:
                with self.guard:
                    self.inside -= 1

        return call


def test_one_caller_at_a_time_and_the_same_results_under_concurrency():
    tok = Tokenizer(resolve_model_path("smollm2-135m"))
    text = "The quick brown fox jumps over the lazy dog. " * 40
    messages = [{"role": "user", "content": "Name three colours."}]
    ids = tok.encode(text)
    want = {"encode": ids, "decode": tok.decode(ids), "chat": tok.apply_chat_template(messages)}
    want["token_str"] = [tok.token_str(t) for t in ids[:20]]
    detok = IncrementalDetokenizer(tok)
    want["stream"] = "".join(detok.add(t) for t in ids[:60])
    tok.hf = Spy(tok.hf)
    got: dict[str, list] = {k: [] for k in want}
    errors: list[BaseException] = []

    def work(kind: str) -> None:
        try:
            for _ in range(15):
                if kind == "encode":
                    got[kind].append(tok.encode(text))
                elif kind == "decode":
                    got[kind].append(tok.decode(ids))
                elif kind == "chat":
                    got[kind].append(tok.apply_chat_template(messages))
                elif kind == "token_str":
                    got[kind].append([tok.token_str(t) for t in ids[:20]])
                else:
                    d = IncrementalDetokenizer(tok)
                    got[kind].append("".join(d.add(t) for t in ids[:60]))
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=work, args=(kind,)) for kind in want]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    assert tok.hf.most == 1, f"{tok.hf.most} callers were inside the HF tokenizer at once"
    for kind, values in got.items():
        assert values == [want[kind]] * 15, kind


def test_a_tokenizer_pickles_with_a_lock_of_its_own():
    """A cluster replica sends its Tokenizer to the ingress (ReplicaInfo): it must pickle, and the copy
    gets a new lock (before: "cannot pickle '_thread.lock' object" and no cluster started)."""
    import pickle

    tok = Tokenizer(resolve_model_path("tiny-random-llama"))
    copy = pickle.loads(pickle.dumps(tok))
    assert copy._lock is not tok._lock and not copy._lock.locked()
    assert copy.encode("hello world") == tok.encode("hello world")


TEXTS = [
    "Hello, café culture in Paris — naïve façade.",
    "日本語のテキストと絵文字 🎉🚀 mixed with English.",
    "  leading spaces\tand\ttabs\n\nnewlines",
    "ümlaut ß ø å 😀😃 𝔘𝔫𝔦𝔠𝔬𝔡𝔢",
    "def f(x):\n    return x ** 2  # code",
]


def test_the_streamed_detokenizer_equals_the_window_reference():
    """DecodeStream (the fast path) gives the reference's deltas: multi-byte characters split across
    tokens, prompt context, byte-fallback and special tokens in random id sequences."""
    import random

    for name in ("smollm2-135m", "tiny-random-llama"):
        tok = Tokenizer(resolve_model_path(name))
        assert IncrementalDetokenizer(tok)._stream is not None  # a fast tokenizer: the stream is used
        cases = [(tok.encode(t)[:k], tok.encode(t)[k:]) for t in TEXTS for k in (0, 3)]
        rng = random.Random(0)
        cases += [([], [rng.randrange(tok.vocab_size) for _ in range(30)]) for _ in range(100)]
        for tail, ids in cases:
            fast = IncrementalDetokenizer(tok, tail)
            slow = IncrementalDetokenizer(tok, tail, window=True)
            assert [fast.add(i) for i in ids] == [slow.add(i) for i in ids], (name, tail, ids)


def test_text_prompts_add_only_what_the_tokenizer_adds():
    """encode_prompt adds the tokenizer's own special tokens (Gemma's <bos>); SmolLM2's adds none, so
    its prompts are encode's."""
    from kvserve.models.loader import resolve_model_path
    from kvserve.tokenizer import Tokenizer

    tok = Tokenizer(resolve_model_path("smollm2-135m"))
    for text in ("Hello world", "", "<|im_start|>user"):
        assert tok.encode_prompt(text) == tok.encode(text)
