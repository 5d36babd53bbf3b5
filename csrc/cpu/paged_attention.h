// The CPU attention kernel's driver: work items, one online-softmax step, one item, all rows.
// The arithmetic is in attention_math.h, the formats in kv_readers.h, the entry points and checks in
// paged_attention_cpu.cpp (which has the design notes).
#pragma once

#include <ATen/Parallel.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <map>
#include <utility>
#include <vector>

#include "attention_math.h"
#include "kv_readers.h"
#include "parallel.h"

namespace kvserve_cpu {

constexpr int64_t kStepTokens = 64;     // online-softmax step (at least a block)
constexpr int64_t kSplitTokens = 256;   // KV split length (at least a step)
constexpr int64_t kTileRows = 32;       // query rows per item (a performance choice only)
constexpr int64_t kSplitModeRows = 16;  // a sequence of at most this many rows: an item per split

struct Problem {
  int64_t num_seqs, num_rows, num_heads, h_kv, d, block_size, max_blocks, step_tokens, split_tokens;
  float scale;
  const int32_t* block_tables;  // [num_seqs, max_blocks]
  const int32_t* seq_lens;      // [num_seqs]
  const int32_t* row_start;     // [num_seqs + 1]
  std::vector<int32_t> pos;     // [num_rows]: each row's position
};

// Query rows `rows`, reading KV through sequence seq's block table; split >= 0: only that split, stored
// as a partial. The rows are one sequence's, or (a shared split) those of every sequence whose block
// table holds the same blocks over the whole split: a prefix cached once and used by several requests
// is then read, and its K transposed, once per step for all of them.
struct Item {
  int64_t seq, split, cost;
  std::vector<int64_t> rows;
};

// Per-thread buffers, sized for the largest item. Per-step K/V state is per KV head: [h_kv][...].
struct Work {
  std::vector<Scratch> scratch;  // one per (block of a step, KV head)
  std::vector<float> zeros, kt, k_mult, v_mult, scores, acc, total;
  std::vector<float> m, l, tm, tl, corr;
  std::vector<int32_t> lane_pos, active, n_valid;
  std::vector<const float*> lane_q, tok_k, tok_v, q_act, p_act;
  std::vector<float*> s_ptr, acc_ptr;
  std::vector<bool> has_k_mult, has_v_mult;
  Work(const Problem& p, int64_t lanes)
      : scratch(p.step_tokens / p.block_size * p.h_kv, Scratch(p.block_size, p.d)), zeros(p.d),
        kt(p.h_kv * p.d * p.step_tokens), k_mult(p.h_kv * p.step_tokens), v_mult(p.h_kv * p.step_tokens),
        scores(lanes * p.step_tokens), acc(lanes * p.d), total(lanes * p.d), m(lanes), l(lanes), tm(lanes),
        tl(lanes), corr(lanes), lane_pos(lanes), active(lanes), n_valid(lanes), lane_q(lanes),
        tok_k(p.h_kv * p.step_tokens), tok_v(p.h_kv * p.step_tokens), q_act(lanes), p_act(lanes), s_ptr(lanes),
        acc_ptr(lanes), has_k_mult(p.h_kv), has_v_mult(p.h_kv) {}
};

// Reads the blocks of the step [start, start + n) for every KV head, in the order they lie in memory
// (block, then token group, then head): token rows in w.tok_k / w.tok_v, K transposed into w.kt,
// per-token multipliers. Then prefetches the next step's blocks.
template <int D, typename Reader>
void read_step(const Problem& p, const Reader& reader, Work& w, int64_t seq, int64_t start, int64_t n,
               int64_t next_n) {
  const int64_t sp = p.step_tokens, bs = p.block_size;
  for (int64_t t0 = 0; t0 < n; t0 += bs) {
    const int64_t block = p.block_tables[seq * p.max_blocks + (start + t0) / bs];
    const int64_t count = std::min(bs, n - t0);
    for (int64_t h = 0; h < p.h_kv; ++h) {
      const BlockRows rows = reader.rows(block, h, count, w.scratch[t0 / bs * p.h_kv + h]);
      for (int64_t t = 0; t < count; ++t) {
        w.tok_k[h * sp + t0 + t] = rows.k + t * rows.stride;
        w.tok_v[h * sp + t0 + t] = rows.v + t * rows.stride;
      }
      w.has_k_mult[h] = rows.k_mult != nullptr, w.has_v_mult[h] = rows.v_mult != nullptr;
      if (rows.k_mult) std::copy(rows.k_mult, rows.k_mult + count, w.k_mult.begin() + h * sp + t0);
      if (rows.v_mult) std::copy(rows.v_mult, rows.v_mult + count, w.v_mult.begin() + h * sp + t0);
    }
  }
  const int64_t padded = (n + 4 * kLanes - 1) / (4 * kLanes) * (4 * kLanes);  // what score_tile reads
  for (int64_t h = 0; h < p.h_kv; ++h)
    for (int64_t t = n; t < padded; ++t) w.tok_k[h * sp + t] = w.zeros.data();
  for (int64_t t0 = 0; t0 < padded; t0 += kLanes)
    for (int64_t h = 0; h < p.h_kv; ++h)
      for (int d0 = 0; d0 < D; d0 += kLanes)
        transpose_tile(w.tok_k.data() + h * sp + t0, d0, w.kt.data() + (h * D + d0) * sp + t0, sp);
  for (int64_t t0 = 0; t0 < next_n; t0 += bs) {
    const int64_t block = p.block_tables[seq * p.max_blocks + (start + sp + t0) / bs];
    for (int64_t h = 0; h < p.h_kv; ++h) reader.prefetch(block, h, std::min(bs, next_n - t0));
  }
}

// One online-softmax step of KV head h (read by read_step) for the lanes of its query heads that see
// it (lane = local row * num_heads + query head).
template <int D>
void run_step(const Problem& p, Work& w, int64_t h, int64_t start, int64_t num_rows, int64_t n_max) {
  const int64_t sp = p.step_tokens, group = p.num_heads / p.h_kv;
  int64_t num_active = 0;
  int64_t n_common = sp;
  for (int64_t i = 0; i < num_rows * group; ++i) {
    const int64_t lane = (i / group) * p.num_heads + h * group + i % group;
    if (w.lane_pos[lane] < start) continue;
    const int64_t n = std::min<int64_t>(sp, w.lane_pos[lane] + 1 - start);
    w.active[num_active] = static_cast<int32_t>(lane);
    w.n_valid[num_active] = static_cast<int32_t>(n);
    w.q_act[num_active] = w.lane_q[lane];
    w.s_ptr[num_active] = w.scores.data() + num_active * sp;
    w.p_act[num_active] = w.s_ptr[num_active];
    w.acc_ptr[num_active] = w.acc.data() + lane * D;
    n_common = std::min(n_common, n);
    ++num_active;
  }
  const float* kt = w.kt.data() + h * D * sp;
  const float* const* tok_v = w.tok_v.data() + h * sp;
  const float* k_mult = w.has_k_mult[h] ? w.k_mult.data() + h * sp : nullptr;
  const float* v_mult = w.has_v_mult[h] ? w.v_mult.data() + h * sp : nullptr;
  const int64_t nv = (n_max + 4 * kLanes - 1) / (4 * kLanes) * 4;
  score_lanes<D, 4>(w.q_act.data(), kt, sp, nv, w.s_ptr.data(), num_active);
  for (int64_t a = 0; a < num_active; ++a) {
    const int64_t lane = w.active[a];
    w.corr[a] = softmax_step(w.s_ptr[a], w.n_valid[a], k_mult, v_mult, w.m[lane], w.l[lane]);
  }
  pv_lanes<D, pv_rows(D)>(w.acc_ptr.data(), w.p_act.data(), w.corr.data(), tok_v, n_common, num_active);
  for (int64_t a = 0; a < num_active; ++a) {  // lanes that see more of the step than all do
    if (w.n_valid[a] > n_common) pv_tile<D, 1>(&w.acc_ptr[a], &w.p_act[a], nullptr, tok_v, n_common, w.n_valid[a]);
  }
}

// Blocks in order of position, and for each step every KV head, so that a block's bytes (all heads,
// interleaved) are read together: one pass over the sequence's KV. Lane = local row * H + query head.
template <int D, typename Reader>
void run_item(const Problem& p, const Reader& reader, Work& w, const Item& it, const float* q, float* out,
              float* partials, const int64_t* partial_base) {
  const int64_t h_all = p.num_heads, st = p.split_tokens, num_rows = static_cast<int64_t>(it.rows.size());
  const int64_t num_lanes = num_rows * h_all;
  int64_t max_pos = 0;
  for (const int64_t r : it.rows) max_pos = std::max<int64_t>(max_pos, p.pos[r]);
  const int64_t first_split = it.split >= 0 ? it.split : 0;
  const int64_t last_split = it.split >= 0 ? it.split : max_pos / st;
  for (int64_t lane = 0; lane < num_lanes; ++lane) {
    const int64_t r = it.rows[lane / h_all];
    w.lane_pos[lane] = p.pos[r];
    w.lane_q[lane] = q + (r * h_all + lane % h_all) * D;
    w.tm[lane] = kNegInf;
  }
  for (int64_t split = first_split; split <= last_split; ++split) {
    const int64_t split_begin = split * st;
    std::fill(w.acc.begin(), w.acc.begin() + num_lanes * D, 0.f);
    std::fill(w.m.begin(), w.m.begin() + num_lanes, kNegInf);
    std::fill(w.l.begin(), w.l.begin() + num_lanes, 0.f);
    for (int64_t start = split_begin; start < split_begin + st && start <= max_pos; start += p.step_tokens) {
      const int64_t n_max = std::min<int64_t>(p.step_tokens, max_pos + 1 - start);
      const int64_t next_n = std::min<int64_t>(p.step_tokens, max_pos + 1 - start - p.step_tokens);
      read_step<D>(p, reader, w, it.seq, start, n_max, next_n);
      for (int64_t h = 0; h < p.h_kv; ++h) run_step<D>(p, w, h, start, num_rows, n_max);
    }
    for (int64_t lane = 0; lane < num_lanes; ++lane) {
      if (w.lane_pos[lane] < split_begin) continue;
      if (it.split >= 0) {  // a partial for the final fold: [acc D, m, l] per (row, split, head)
        const int64_t r = it.rows[lane / h_all];
        float* dst = partials + ((partial_base[r] + split) * h_all + lane % h_all) * (D + 2);
        std::memcpy(dst, w.acc.data() + lane * D, D * sizeof(float));
        dst[D] = w.m[lane], dst[D + 1] = w.l[lane];
      } else {
        fold<D>(w.total.data() + lane * D, w.tm[lane], w.tl[lane], w.acc.data() + lane * D, w.m[lane], w.l[lane]);
      }
    }
  }
  if (it.split >= 0) return;
  for (int64_t lane = 0; lane < num_lanes; ++lane) {
    finish<D>(w.total.data() + lane * D, w.tl[lane], out + (it.rows[lane / h_all] * h_all + lane % h_all) * D);
  }
}

inline std::vector<int64_t> row_range(int64_t begin, int64_t end) {
  std::vector<int64_t> rows(end - begin);
  for (int64_t r = begin; r < end; ++r) rows[r - begin] = r;
  return rows;
}

// Split mode (a sequence of at most kSplitModeRows rows, more than one split): an item per split, so a
// decode row spreads over threads, and a split that several such sequences hold in the same blocks
// (a shared cached prefix) is one item for all their rows. Other sequences: tiles of kTileRows rows over
// all splits. The arithmetic of a (row, head) is the same in every case: splits at fixed positions,
// folded in order (paged_attention_cpu.cpp).
inline std::vector<Item> plan_items(const Problem& p, std::vector<int64_t>& partial_base, int64_t& num_partials) {
  std::vector<Item> items;
  num_partials = 0;
  const int64_t st = p.split_tokens, blocks_per_split = st / p.block_size;
  std::map<std::vector<int32_t>, size_t> shared;  // (split, its block ids) -> item
  for (int64_t b = 0; b < p.num_seqs; ++b) {
    const int64_t r0 = p.row_start[b], r1 = p.row_start[b + 1];
    if (r0 == r1) continue;
    int64_t max_pos = 0, min_pos = p.pos[r0];
    for (int64_t r = r0; r < r1; ++r) max_pos = std::max<int64_t>(max_pos, p.pos[r]), min_pos = std::min<int64_t>(min_pos, p.pos[r]);
    const int64_t num_splits = max_pos / st + 1;
    if (r1 - r0 <= kSplitModeRows && num_splits > 1) {
      for (int64_t r = r0; r < r1; ++r) {
        partial_base[r] = num_partials;
        num_partials += p.pos[r] / st + 1;
      }
      for (int64_t s = 0; s < num_splits; ++s) {
        int64_t cost = 0;
        for (int64_t r = r0; r < r1; ++r)
          cost += std::max<int64_t>(0, std::min<int64_t>(p.pos[r] + 1, (s + 1) * st) - s * st);
        if ((s + 1) * st <= min_pos) {  // every row sees the whole split: it may be shared
          std::vector<int32_t> key(blocks_per_split + 1);
          key[0] = static_cast<int32_t>(s);
          const int32_t* table = p.block_tables + b * p.max_blocks + s * blocks_per_split;
          std::copy(table, table + blocks_per_split, key.begin() + 1);
          const auto [at, added] = shared.emplace(std::move(key), items.size());
          if (!added) {
            Item& item = items[at->second];
            for (int64_t r = r0; r < r1; ++r) item.rows.push_back(r);
            item.cost += cost;
            continue;
          }
        }
        items.push_back({b, s, cost, row_range(r0, r1)});
      }
      continue;
    }
    for (int64_t a = r0; a < r1; a += kTileRows) {
      const int64_t e = std::min(a + kTileRows, r1);
      int64_t cost = 0;
      for (int64_t r = a; r < e; ++r) cost += p.pos[r] + 1;
      items.push_back({b, -1, cost, row_range(a, e)});
    }
  }
  // the costliest first: threads take items as they finish the last (longest processing time first)
  std::stable_sort(items.begin(), items.end(), [](const Item& x, const Item& y) { return x.cost > y.cost; });
  return items;
}

template <int D, typename Reader>
void run_rows(const Problem& p, const Reader& reader, const float* q, float* out) {
  std::vector<int64_t> partial_base(p.num_rows, -1);
  int64_t num_partials = 0;
  const std::vector<Item> items = plan_items(p, partial_base, num_partials);
  int64_t max_rows = 1;
  for (const Item& it : items) max_rows = std::max<int64_t>(max_rows, static_cast<int64_t>(it.rows.size()));
  std::vector<float> partials(num_partials * p.num_heads * (D + 2));
  parallel_chunks_with(
      static_cast<int64_t>(items.size()), 1, 1, [&] { return Work(p, max_rows * p.num_heads); },
      [&](Work& w, int64_t i, int64_t) { run_item<D>(p, reader, w, items[i], q, out, partials.data(), partial_base.data()); });
  if (num_partials == 0) return;
  parallel_chunks(p.num_rows, 1, 1, [&](int64_t first, int64_t last) {
    std::vector<float> ta(D);
    for (int64_t r = first; r < last; ++r) {
      if (partial_base[r] < 0) continue;
      for (int64_t head = 0; head < p.num_heads; ++head) {
        float tm = kNegInf, tl = 0.f;
        for (int64_t s = 0; s <= p.pos[r] / p.split_tokens; ++s) {
          const float* part = partials.data() + ((partial_base[r] + s) * p.num_heads + head) * (D + 2);
          fold<D>(ta.data(), tm, tl, part, part[D], part[D + 1]);
        }
        finish<D>(ta.data(), tl, out + (r * p.num_heads + head) * D);
      }
    }
  });
}

template <typename Reader>
using RunFn = void (*)(const Problem&, const Reader&, const float*, float*);

template <typename Reader>
RunFn<Reader> run_for_head_dim(int64_t d) {
  switch (d) {
    case 16: return &run_rows<16, Reader>;
    case 32: return &run_rows<32, Reader>;
    case 64: return &run_rows<64, Reader>;
    case 128: return &run_rows<128, Reader>;
    case 256: return &run_rows<256, Reader>;
    default: TORCH_CHECK(false, "head_dim must be 16, 32, 64, 128 or 256, got ", d);
  }
}

}  // namespace kvserve_cpu
