// The CPU attention kernel's driver: work items, one online-softmax step, one item, all rows.
// The arithmetic is in attention_math.h, the formats in kv_readers.h, the entry points and checks in
// paged_attention_cpu.cpp (which has the design notes).
#pragma once

#include <algorithm>
#include <cstdint>
#include <map>
#include <optional>
#include <type_traits>
#include <utility>
#include <vector>

#include "attention_amx.h"
#include "attention_math.h"
#include "kv_readers.h"
#include "parallel.h"

namespace kvserve_cpu {

constexpr int64_t kStepTokens = 64;     // online-softmax step (at least a block)
constexpr int64_t kSplitTokens = 256;   // KV split length (at least a step)
// query rows per item (a performance choice only): as many as keep about four items per thread, from
// 32 to 128 (K is transposed and V interleaved once per item and step: larger items amortise it)
constexpr int64_t kMinTileRows = 32, kMaxTileRows = 128;
constexpr int64_t kSplitModeRows = 16;  // a sequence of at most this many rows: an item per split

struct Problem {
  int64_t num_seqs, num_rows, num_heads, h_kv, d, block_size, max_blocks, step_tokens, split_tokens;
  float scale;
  const int32_t* block_tables;  // [num_seqs, max_blocks]
  const int32_t* seq_lens;      // [num_seqs]
  const int32_t* row_start;     // [num_seqs + 1]
  std::vector<int32_t> pos;     // [num_rows]: each row's position
  int64_t window;               // > 0: a row at position p sees (p - window, p] (a sliding-window layer)
  std::vector<int32_t> lo;      // [num_rows]: the first position each row sees (0 without a window)
};

// Query rows `rows`, reading KV through sequence seq's block table; split >= 0: only that split, stored
// as a partial. The rows are one sequence's, or (a shared split) those of every sequence whose block
// table holds the same blocks over the whole split: a prefix cached once and used by several requests
// is then read, and its K transposed, once per step for all of them.
struct Item {
  int64_t seq, split, cost;
  std::vector<int64_t> rows;
};

// Per-thread buffers, sized for the largest item, typed by the arithmetic M. Per-step K/V state is per KV
// head: [h_kv][...]. K transposed is kt [h_kv][D / M::kPack][sp] (fp32 values, or bf16 channel pairs).
template <typename M>
struct Work {
  static constexpr bool kBf16 = std::is_same_v<M, Bf16Math>;
  std::vector<Scratch> scratch;  // fp32: one per (block of a step, KV head)
  std::vector<typename M::K> kt;
  std::vector<float> zeros, k_mult, v_mult, scores, acc, total;
  std::vector<float> m, l, tm, tl, corr;
  std::vector<int32_t> lane_pos, lane_lo, active, n_valid, first_valid;
  std::vector<const typename M::Q*> lane_q, q_act;
  std::vector<const typename M::P*> p_act;  // fp32: the scores, overwritten with probabilities
  std::vector<const float*> tok_k, tok_v;
  std::vector<float*> s_ptr, acc_ptr;
  std::vector<bool> has_k_mult, has_v_mult;
  // bf16 only: V interleaved by token pairs [h_kv][D / kLanes][sp / 2][kLanes], V's rows, the rounded
  // probabilities [lanes][sp] (16 rows more: the AMX tiles' last partial tile reads them)
  std::vector<uint32_t> vt2;
  std::vector<const uint16_t*> tok_v16;
  std::vector<uint16_t> probs16;
#ifdef KVSERVE_HAVE_AMX
  // bf16 on AMX tiles (attention_amx.h), when amx::attention_on(D) at the start of the call
  std::optional<amx::AttentionTiles> tiles;
#endif
  Work(const Problem& p, int64_t lanes)
      : scratch(kBf16 ? 0 : p.step_tokens / p.block_size * p.h_kv, Scratch(p.block_size, p.d)),
        kt(p.h_kv * p.d / M::kPack * p.step_tokens), zeros(p.d), k_mult(p.h_kv * p.step_tokens),
        v_mult(p.h_kv * p.step_tokens), scores((lanes + 16) * p.step_tokens), acc(lanes * p.d), total(lanes * p.d), m(lanes),
        l(lanes), tm(lanes), tl(lanes), corr(lanes), lane_pos(lanes), lane_lo(lanes), active(lanes), n_valid(lanes),
        first_valid(lanes), lane_q(lanes),
        q_act(lanes), p_act(lanes), tok_k(p.h_kv * p.step_tokens), tok_v(p.h_kv * p.step_tokens), s_ptr(lanes),
        acc_ptr(lanes), has_k_mult(p.h_kv), has_v_mult(p.h_kv), vt2(kBf16 ? p.h_kv * p.d / 2 * p.step_tokens : 0),
        tok_v16(kBf16 ? p.h_kv * p.step_tokens : 0), probs16(kBf16 ? (lanes + 16) * p.step_tokens : 0) {}
};

// Reads the blocks of the step [start, start + n) for every KV head, in the order they lie in memory
// (block, then token group, then head): token rows in w.tok_k / w.tok_v, K transposed into w.kt,
// per-token multipliers. Then prefetches the next step's blocks.
template <int D, typename Reader>
void read_step(const Problem& p, const Reader& reader, Work<Fp32Math>& w, int64_t seq, int64_t start, int64_t n,
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

// read_step for the bf16 arithmetic over a bf16 pool, read in place without conversion: K's rows, as
// D / 2 channel pairs, transposed into w.kt (the same 32-bit tile transpose); V's rows interleaved by
// token pairs into w.vt2. Tokens past n read as zeros.
template <int D>
void read_step_bf16(const Problem& p, const DenseReader<at::BFloat16>& reader, Work<Bf16Math>& w, int64_t seq, int64_t start,
                    int64_t n, int64_t next_n) {
  const int64_t sp = p.step_tokens, bs = p.block_size, stride = p.h_kv * D;
  const auto* k = reinterpret_cast<const uint16_t*>(reader.k);
  const auto* v = reinterpret_cast<const uint16_t*>(reader.v);
  for (int64_t t0 = 0; t0 < n; t0 += bs) {
    const int64_t block = p.block_tables[seq * p.max_blocks + (start + t0) / bs];
    const int64_t count = std::min(bs, n - t0);
    for (int64_t h = 0; h < p.h_kv; ++h) {
      const int64_t first = (block * bs * p.h_kv + h) * D;
      for (int64_t t = 0; t < count; ++t) {
        w.tok_k[h * sp + t0 + t] = reinterpret_cast<const float*>(k + first + t * stride);  // D / 2 pairs
        w.tok_v16[h * sp + t0 + t] = v + first + t * stride;
      }
    }
  }
  const int64_t padded = (n + 4 * kLanes - 1) / (4 * kLanes) * (4 * kLanes);  // what score_tile reads
  const auto* zeros16 = reinterpret_cast<const uint16_t*>(w.zeros.data());  // D floats: 2 D zero bf16
  for (int64_t h = 0; h < p.h_kv; ++h) {
    for (int64_t t = n; t < padded; ++t) w.tok_k[h * sp + t] = w.zeros.data(), w.tok_v16[h * sp + t] = zeros16;
  }
#ifdef KVSERVE_HAVE_AMX
  if (w.tiles.has_value()) {  // the tiles read K's rows and V^T (attention_amx.h), not the lanes' layouts
    amx::read_kv<D>(*w.tiles, reinterpret_cast<const uint16_t* const*>(w.tok_k.data()), w.tok_v16.data(), padded, n,
                    stride * 2, w.zeros.data());
    return;
  }
#endif
  auto* kt2 = reinterpret_cast<float*>(w.kt.data());
  for (int64_t t0 = 0; t0 < padded; t0 += kLanes)
    for (int64_t h = 0; h < p.h_kv; ++h)
      for (int d0 = 0; d0 < D / 2; d0 += kLanes)
        transpose_tile(w.tok_k.data() + h * sp + t0, d0, kt2 + (h * D / 2 + d0) * sp + t0, sp);
  typedef uint16_t vh __attribute__((vector_size(kLanes * sizeof(uint16_t))));
  for (int64_t h = 0; h < p.h_kv; ++h) {
    const uint16_t* const* rows = w.tok_v16.data() + h * sp;
    uint32_t* dst = w.vt2.data() + h * D / 2 * sp;
    for (int64_t u = 0; u < padded / 2; ++u) {
      for (int c = 0; c < D / kLanes; ++c) {
        vh lo, hi;
        std::memcpy(&lo, rows[2 * u] + c * kLanes, sizeof(vh));
        std::memcpy(&hi, rows[2 * u + 1] + c * kLanes, sizeof(vh));
        const vu pair = __builtin_convertvector(lo, vu) | (__builtin_convertvector(hi, vu) << 16);
        std::memcpy(dst + (c * (sp / 2) + u) * kLanes, &pair, sizeof(vu));
      }
    }
  }
  for (int64_t t0 = 0; t0 < next_n; t0 += bs) {
    const int64_t block = p.block_tables[seq * p.max_blocks + (start + sp + t0) / bs];
    for (int64_t h = 0; h < p.h_kv; ++h) reader.prefetch(block, h, std::min(bs, next_n - t0));
  }
}

// One online-softmax step of KV head h (read by read_step) for the lanes of its query heads that see
// it (lane = local row * num_heads + query head).
template <int D, typename M>
void run_step(const Problem& p, Work<M>& w, int64_t h, int64_t start, int64_t num_rows, int64_t n_max) {
  constexpr bool kBf16 = Work<M>::kBf16;
  const int64_t sp = p.step_tokens, group = p.num_heads / p.h_kv;
  int64_t num_active = 0;
  int64_t n_common = sp;
  for (int64_t i = 0; i < num_rows * group; ++i) {
    const int64_t lane = (i / group) * p.num_heads + h * group + i % group;
    if (w.lane_pos[lane] < start || w.lane_lo[lane] >= start + sp) continue;
    const int64_t n = std::min<int64_t>(sp, w.lane_pos[lane] + 1 - start);
    w.active[num_active] = static_cast<int32_t>(lane);
    w.n_valid[num_active] = static_cast<int32_t>(n);
    w.first_valid[num_active] = static_cast<int32_t>(std::max<int64_t>(0, w.lane_lo[lane] - start));
    w.q_act[num_active] = w.lane_q[lane];
    w.s_ptr[num_active] = w.scores.data() + num_active * sp;
    if constexpr (kBf16) {
      w.p_act[num_active] = w.probs16.data() + num_active * sp;
    } else {
      w.p_act[num_active] = w.s_ptr[num_active];
    }
    w.acc_ptr[num_active] = w.acc.data() + lane * D;
    n_common = std::min(n_common, n);
    ++num_active;
  }
  const int64_t nv = (n_max + 4 * kLanes - 1) / (4 * kLanes) * 4;
  const float* k_mult = w.has_k_mult[h] ? w.k_mult.data() + h * sp : nullptr;
  const float* v_mult = w.has_v_mult[h] ? w.v_mult.data() + h * sp : nullptr;
  score_lanes<D, 4, M>(w.q_act.data(), w.kt.data() + h * (D / M::kPack) * sp, sp, nv, p.scale, w.s_ptr.data(),
                       num_active);
  for (int64_t a = 0; a < num_active; ++a) {
    const int64_t lane = w.active[a];
    if constexpr (kBf16) {  // probabilities past n_valid are 0: a lane's last pair may hold one
      const bool whole = w.first_valid[a] == 0 && w.n_valid[a] == sp;
      w.corr[a] = (whole ? softmax_step_bf16<true> : softmax_step_bf16<false>)(
          w.s_ptr[a], w.n_valid[a], w.first_valid[a], p.scale * kLog2e, w.m[lane], w.l[lane], w.probs16.data() + a * sp);
    } else {
      w.corr[a] = softmax_step(w.s_ptr[a], w.n_valid[a], k_mult, v_mult, w.m[lane], w.l[lane], w.first_valid[a]);
    }
  }
  // Units of the P V chain: tokens (fp32) or token pairs (bf16). All lanes run [0, common) together,
  // then each the rest of its own; where that boundary falls never changes a lane's chain.
  const int64_t common = n_common / M::kPack;
  typename M::V v;
  if constexpr (kBf16) {
    v = {w.vt2.data() + h * D / 2 * sp, sp / 2};
  } else {
    v = {w.tok_v.data() + h * sp};
  }
  pv_lanes<D, pv_rows(D), M>(w.acc_ptr.data(), w.p_act.data(), w.corr.data(), v, common, num_active);
  for (int64_t a = 0; a < num_active; ++a) {
    const int64_t end = (w.n_valid[a] + M::kPack - 1) / M::kPack;
    if (end > common) pv_tile<D, 1, M>(&w.acc_ptr[a], &w.p_act[a], nullptr, v, common, end);
  }
}

// Blocks in order of position, and for each step every KV head, so that a block's bytes (all heads,
// interleaved) are read together: one pass over the sequence's KV. Lane = local row * H + query head.
template <int D, typename Reader, typename M>
void run_item(const Problem& p, const Reader& reader, Work<M>& w, const Item& it, const typename M::Q* q, float* out,
              float* partials, const int64_t* partial_base) {
  const int64_t h_all = p.num_heads, st = p.split_tokens, num_rows = static_cast<int64_t>(it.rows.size());
  const int64_t num_lanes = num_rows * h_all;
  int64_t max_pos = 0, min_lo = p.pos[it.rows[0]];
  for (const int64_t r : it.rows) max_pos = std::max<int64_t>(max_pos, p.pos[r]), min_lo = std::min<int64_t>(min_lo, p.lo[r]);
  const int64_t first_split = it.split >= 0 ? it.split : 0;
  const int64_t last_split = it.split >= 0 ? it.split : max_pos / st;
  for (int64_t lane = 0; lane < num_lanes; ++lane) {
    const int64_t r = it.rows[lane / h_all];
    w.lane_pos[lane] = p.pos[r];
    w.lane_lo[lane] = p.lo[r];
    w.lane_q[lane] = q + (r * h_all + lane % h_all) * (D / M::kPack);
    w.tm[lane] = kNegInf;
  }
#ifdef KVSERVE_HAVE_AMX
  amx::AttentionTiles* tiles = nullptr;  // bf16 on AMX tiles: set once per call (run_rows)
  if constexpr (Work<M>::kBf16) {
    if (w.tiles.has_value()) {
      tiles = &*w.tiles;
      amx::pack_lanes<D>(*tiles, w.lane_q.data(), w.lane_pos.data(), w.lane_lo.data(), num_rows, p.num_heads);
    }
  }
#endif
  for (int64_t split = first_split; split <= last_split; ++split) {
    const int64_t split_begin = split * st;
#ifdef KVSERVE_HAVE_AMX
    if (tiles) {
      amx::begin_split(*tiles, split_begin);
    } else
#endif
    {
      std::fill(w.acc.begin(), w.acc.begin() + num_lanes * D, 0.f);
      std::fill(w.m.begin(), w.m.begin() + num_lanes, kNegInf);
      std::fill(w.l.begin(), w.l.begin() + num_lanes, 0.f);
    }
    for (int64_t start = split_begin; start < split_begin + st && start <= max_pos; start += p.step_tokens) {
      if (start + p.step_tokens <= min_lo) continue;  // before every row's window: nothing to read
      const int64_t n_max = std::min<int64_t>(p.step_tokens, max_pos + 1 - start);
      const int64_t next_n = std::min<int64_t>(p.step_tokens, max_pos + 1 - start - p.step_tokens);
      if constexpr (Work<M>::kBf16) {
        read_step_bf16<D>(p, reader, w, it.seq, start, n_max, next_n);
      } else {
        read_step<D>(p, reader, w, it.seq, start, n_max, next_n);
      }
      for (int64_t h = 0; h < p.h_kv; ++h) {
#ifdef KVSERVE_HAVE_AMX
        if (tiles) {
          amx::run_step<D>(*tiles, h, start, n_max, p.scale);
          continue;
        }
#endif
        run_step<D, M>(p, w, h, start, num_rows, n_max);
      }
    }
#ifdef KVSERVE_HAVE_AMX
    if (tiles) {
      amx::end_split<D>(*tiles, split_begin, p.num_heads, w.acc.data(), w.m.data(), w.l.data());
    } else
#endif
    if constexpr (Work<M>::kBf16) {  // the lanes' max from log2 units to natural ones, as end_split does
      for (int64_t lane = 0; lane < num_lanes; ++lane) w.m[lane] *= kLn2;
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
// (a shared cached prefix) is one item for all their rows. Other sequences: tiles of kMinTileRows to
// kMaxTileRows rows over all splits. The arithmetic of a (row, head) is the same in every case: splits
// at fixed positions, folded in order (paged_attention_cpu.cpp).
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
    const int64_t per_item = 4 * at::get_num_threads();
    const int64_t tile = std::clamp<int64_t>((r1 - r0 + per_item - 1) / per_item, kMinTileRows, kMaxTileRows);
    for (int64_t a = r0; a < r1; a += tile) {
      const int64_t e = std::min(a + tile, r1);
      int64_t cost = 0;
      for (int64_t r = a; r < e; ++r) cost += p.pos[r] + 1;
      items.push_back({b, -1, cost, row_range(a, e)});
    }
  }
  // the costliest first: threads take items as they finish the last (longest processing time first)
  std::stable_sort(items.begin(), items.end(), [](const Item& x, const Item& y) { return x.cost > y.cost; });
  return items;
}

template <int D, typename Reader, typename M>
void run_rows(const Problem& p, const Reader& reader, const typename M::Q* q, float* out) {
  std::vector<int64_t> partial_base(p.num_rows, -1);
  int64_t num_partials = 0;
  const std::vector<Item> items = plan_items(p, partial_base, num_partials);
  int64_t max_rows = 1;
  for (const Item& it : items) max_rows = std::max<int64_t>(max_rows, static_cast<int64_t>(it.rows.size()));
  std::vector<float> partials(num_partials * p.num_heads * (D + 2));
  parallel_chunks_with(
      static_cast<int64_t>(items.size()), 1, 1,
      [&] {
        Work<M> w(p, max_rows * p.num_heads);
#ifdef KVSERVE_HAVE_AMX
        if (Work<M>::kBf16 && amx::attention_on(D)) {  // a path per call, never per row
          amx::configure();
          // K read in the pool where a 16-token tile lies in one block (attention_amx.h read_kv)
          w.tiles.emplace(D, p.step_tokens, p.h_kv, max_rows * (p.num_heads / p.h_kv), p.block_size < 16);
        }
#endif
        return w;
      },
      [&](Work<M>& w, int64_t i, int64_t) {
        run_item<D, Reader, M>(p, reader, w, items[i], q, out, partials.data(), partial_base.data());
      });
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

template <typename Reader, typename M = Fp32Math>
using RunFn = void (*)(const Problem&, const Reader&, const typename M::Q*, float*);

template <typename Reader, typename M = Fp32Math>
RunFn<Reader, M> run_for_head_dim(int64_t d) {
  switch (d) {
    case 16: return &run_rows<16, Reader, M>;
    case 32: return &run_rows<32, Reader, M>;
    case 64: return &run_rows<64, Reader, M>;
    case 128: return &run_rows<128, Reader, M>;
    case 256: return &run_rows<256, Reader, M>;
    default: TORCH_CHECK(false, "head_dim must be 16, 32, 64, 128 or 256, got ", d);
  }
}

}  // namespace kvserve_cpu
