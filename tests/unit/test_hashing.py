import random

from kvserve.kvcache.hashing import chunk_prefix_hashes, content_hash, root_hash


def _tokens(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(50000) for _ in range(n)]


def test_prompts_sharing_k_chunks_share_exactly_k_leading_hashes():
    root = root_hash("ns")
    base = _tokens(8 * 16, 0)
    for k in range(0, 8):
        other = base[: k * 16] + _tokens(8 * 16 - k * 16, 100 + k)
        a = chunk_prefix_hashes(base, 16, root)
        b = chunk_prefix_hashes(other, 16, root)
        shared = sum(1 for _ in zip(a, b) if _[0] == _[1])
        assert a[:k] == b[:k]
        assert shared == k, f"k={k}: {shared} equal hashes"


def test_only_full_chunks_are_hashed_and_chaining_resumes():
    root = root_hash("ns")
    tokens = _tokens(50, 1)
    hashes = chunk_prefix_hashes(tokens, 16, root)
    assert len(hashes) == 3
    assert chunk_prefix_hashes(tokens, 16, hashes[0], start_chunk=1) == hashes[1:]


def test_namespace_and_salt_change_every_hash():
    tokens = _tokens(64, 2)
    a = chunk_prefix_hashes(tokens, 16, root_hash("ns"))
    b = chunk_prefix_hashes(tokens, 16, root_hash("ns", "tenant-a"))
    c = chunk_prefix_hashes(tokens, 16, root_hash("other"))
    assert not set(a) & set(b) and not set(a) & set(c) and not set(b) & set(c)


def test_content_hash_is_position_free_and_namespaced():
    chunk = _tokens(16, 3)
    assert content_hash("ns", chunk) == content_hash("ns", list(chunk))
    assert content_hash("ns", chunk) != content_hash("ns2", chunk)
    # the same chunk after different prefixes: different prefix hashes, same content hash
    p1 = chunk_prefix_hashes(_tokens(16, 4) + chunk, 16, root_hash("ns"))[1]
    p2 = chunk_prefix_hashes(_tokens(16, 5) + chunk, 16, root_hash("ns"))[1]
    assert p1 != p2
