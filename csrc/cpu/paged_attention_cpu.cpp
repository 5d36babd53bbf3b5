// Causal paged attention on CPU for any rows: prefill, chunked prefill, decode and rows at explicit
// positions, reading the block table in place (no gathered copy of the history).
//
// Rows: query [T, H, D]; sequence b owns rows [row_start[b], row_start[b + 1]) and KV positions
// [0, seq_lens[b]) through block_tables[b]; a row at position p attends to KV positions [0, p]
// (p = seq_len - q_len + j for the j-th of q_len rows unless positions are given).
//
// Batch invariance: a row's output is a pure function of its query, its position and the KV it
// attends to. Every (row, head) runs the same sequence of operations whatever else is in the call,
// how the rows are tiled, how many threads run, and whether the row came as prefill or decode:
//   - KV is cut into splits at fixed absolute positions [s * split_tokens, (s + 1) * split_tokens),
//     and a split into online-softmax steps of step_tokens (also absolute: 64 tokens, or a block if
//     blocks are larger). Each step: scores, step max, exp, sum, P V (attention_math.h); the last step
//     stops at the row's own position, and masked tokens never enter a sum. The splits of a row are
//     then folded in split order (`fold`), and the result divided by its sum.
//   - a score is q . k summed over d = 0..D-1 by one fused multiply-add chain (K is transposed per
//     step so that vector lanes are tokens); P V is one FMA chain per output element over the tokens
//     in order.
// Work items are (sequence, tile of its rows, split or all splits); a block is read and converted
// once per item for all the rows of the tile and all query heads of a KV head's GQA group. Items
// with one split store a partial result that a final pass folds in order, so that a long sequence
// with a single row (decode) spreads over threads; other items fold as they go. Items run on torch's
// threads (at::parallel_for), costliest first.
#include <torch/extension.h>

#include <ATen/Parallel.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <vector>

#include "attention_math.h"
#include "kv_readers.h"

namespace {

using namespace kvserve_cpu;

constexpr int64_t kStepTokens = 64;     // online-softmax step (at least a block)
constexpr int64_t kSplitTokens = 512;   // KV split length (at least a step)
constexpr int64_t kTileRows = 32;       // query rows per item (a performance choice only)
constexpr int64_t kSplitModeRows = 16;  // sequences with at most this many rows get one item per split

struct Problem {
  int64_t num_seqs, num_rows, num_heads, h_kv, d, block_size, max_blocks, step_tokens, split_tokens;
  float scale;
  const int32_t* block_tables;  // [num_seqs, max_blocks]
  const int32_t* seq_lens;      // [num_seqs]
  const int32_t* row_start;     // [num_seqs + 1]
  std::vector<int32_t> pos;     // [num_rows]: each row's position
};

// Rows [row_begin, row_end) of sequence seq; split >= 0: only that split, stored as a partial.
struct Item {
  int64_t seq, row_begin, row_end, split, cost;
};

// Per-thread buffers, sized for the largest item.
struct Work {
  std::vector<Scratch> scratch;  // one per block of a step
  std::vector<float> zeros, kt, k_mult, v_mult, scores, acc, total;
  std::vector<float> m, l, tm, tl, corr;
  std::vector<int32_t> lane_pos, active, n_valid;
  std::vector<const float*> lane_q, tok_k, tok_v, q_act, p_act;
  std::vector<float*> s_ptr, acc_ptr;
  Work(const Problem& p, int64_t lanes)
      : scratch(p.step_tokens / p.block_size, Scratch(p.block_size, p.d)), zeros(p.d), kt(p.d * p.step_tokens),
        k_mult(p.step_tokens), v_mult(p.step_tokens), scores(lanes * p.step_tokens), acc(lanes * p.d),
        total(lanes * p.d), m(lanes), l(lanes), tm(lanes), tl(lanes), corr(lanes), lane_pos(lanes), active(lanes),
        n_valid(lanes), lane_q(lanes), tok_k(p.step_tokens), tok_v(p.step_tokens), q_act(lanes), p_act(lanes),
        s_ptr(lanes), acc_ptr(lanes) {}
};

// Reads the blocks of the step [start, start + n) of KV head h: token rows in w.tok_k / w.tok_v, K
// transposed into w.kt, per-token multipliers (null = none).
template <int D, typename Reader>
std::pair<const float*, const float*> read_step(const Problem& p, const Reader& reader, Work& w, int64_t seq,
                                                int64_t h, int64_t start, int64_t n) {
  const float* k_mult = nullptr;
  const float* v_mult = nullptr;
  for (int64_t t0 = 0; t0 < n; t0 += p.block_size) {
    const int64_t block = p.block_tables[seq * p.max_blocks + (start + t0) / p.block_size];
    const int64_t count = std::min(p.block_size, n - t0);
    const BlockRows rows = reader.rows(block, h, count, w.scratch[t0 / p.block_size]);
    for (int64_t t = 0; t < count; ++t) {
      w.tok_k[t0 + t] = rows.k + t * rows.stride;
      w.tok_v[t0 + t] = rows.v + t * rows.stride;
    }
    if (rows.k_mult) std::copy(rows.k_mult, rows.k_mult + count, w.k_mult.begin() + t0), k_mult = w.k_mult.data();
    if (rows.v_mult) std::copy(rows.v_mult, rows.v_mult + count, w.v_mult.begin() + t0), v_mult = w.v_mult.data();
  }
  const int64_t padded = (n + 4 * kLanes - 1) / (4 * kLanes) * (4 * kLanes);  // what score_tile reads
  for (int64_t t = n; t < padded; ++t) w.tok_k[t] = w.zeros.data();
  transpose_k<D>(w.tok_k.data(), padded, p.step_tokens, w.kt.data());
  return {k_mult, v_mult};
}

// One online-softmax step [start, start + step) of KV head h for the lanes of its query heads that
// see it (lane = local row * num_heads + query head).
template <int D, typename Reader>
void run_step(const Problem& p, const Reader& reader, Work& w, int64_t seq, int64_t h, int64_t start,
              int64_t num_rows, int64_t max_pos) {
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
  const int64_t n_max = std::min<int64_t>(sp, max_pos + 1 - start);
  const int64_t next = start + sp, next_n = std::min<int64_t>(sp, max_pos + 1 - next);
  for (int64_t t0 = 0; t0 < next_n; t0 += p.block_size) {  // the next step of this head, ahead of use
    reader.prefetch(p.block_tables[seq * p.max_blocks + (next + t0) / p.block_size], h,
                    std::min(p.block_size, next_n - t0));
  }
  const auto [k_mult, v_mult] = read_step<D>(p, reader, w, seq, h, start, n_max);
  const int64_t nv = (n_max + 4 * kLanes - 1) / (4 * kLanes) * 4;
  score_lanes<D, 4>(w.q_act.data(), w.kt.data(), sp, nv, w.s_ptr.data(), num_active);
  for (int64_t a = 0; a < num_active; ++a) {
    const int64_t lane = w.active[a];
    w.corr[a] = softmax_step(w.s_ptr[a], w.n_valid[a], k_mult, v_mult, w.m[lane], w.l[lane]);
  }
  pv_lanes<D, pv_rows(D)>(w.acc_ptr.data(), w.p_act.data(), w.corr.data(), w.tok_v.data(), n_common, num_active);
  for (int64_t a = 0; a < num_active; ++a) {  // lanes that see more of the step than all do
    if (w.n_valid[a] > n_common) pv_tile<D, 1>(&w.acc_ptr[a], &w.p_act[a], nullptr, w.tok_v.data(), n_common, w.n_valid[a]);
  }
}

// Blocks in order of position, and for each step every KV head, so that a block's bytes (all heads,
// interleaved) are read together: one pass over the sequence's KV. Lane = local row * H + query head.
template <int D, typename Reader>
void run_item(const Problem& p, const Reader& reader, Work& w, const Item& it, const float* q, float* out,
              float* partials, const int64_t* partial_base) {
  const int64_t h_all = p.num_heads, st = p.split_tokens, num_rows = it.row_end - it.row_begin;
  const int64_t num_lanes = num_rows * h_all;
  int64_t max_pos = 0;
  for (int64_t r = it.row_begin; r < it.row_end; ++r) max_pos = std::max<int64_t>(max_pos, p.pos[r]);
  const int64_t first_split = it.split >= 0 ? it.split : 0;
  const int64_t last_split = it.split >= 0 ? it.split : max_pos / st;
  for (int64_t lane = 0; lane < num_lanes; ++lane) {
    const int64_t r = it.row_begin + lane / h_all;
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
      for (int64_t h = 0; h < p.h_kv; ++h) run_step<D>(p, reader, w, it.seq, h, start, num_rows, max_pos);
    }
    for (int64_t lane = 0; lane < num_lanes; ++lane) {
      if (w.lane_pos[lane] < split_begin) continue;
      if (it.split >= 0) {  // a partial for the final fold: [acc D, m, l] per (row, split, head)
        const int64_t r = it.row_begin + lane / h_all;
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
    finish<D>(w.total.data() + lane * D, w.tl[lane], out + (it.row_begin * h_all + lane) * D);
  }
}

std::vector<Item> plan_items(const Problem& p, std::vector<int64_t>& partial_base, int64_t& num_partials) {
  std::vector<Item> items;
  num_partials = 0;
  for (int64_t b = 0; b < p.num_seqs; ++b) {
    const int64_t r0 = p.row_start[b], r1 = p.row_start[b + 1];
    if (r0 == r1) continue;
    int64_t max_pos = 0;
    for (int64_t r = r0; r < r1; ++r) max_pos = std::max<int64_t>(max_pos, p.pos[r]);
    const int64_t num_splits = max_pos / p.split_tokens + 1;
    if (r1 - r0 <= kSplitModeRows && num_splits > 1) {
      for (int64_t r = r0; r < r1; ++r) {
        partial_base[r] = num_partials;
        num_partials += p.pos[r] / p.split_tokens + 1;
      }
      for (int64_t s = 0; s < num_splits; ++s) {
        int64_t cost = 0;
        for (int64_t r = r0; r < r1; ++r)
          cost += std::max<int64_t>(0, std::min<int64_t>(p.pos[r] + 1, (s + 1) * p.split_tokens) - s * p.split_tokens);
        items.push_back({b, r0, r1, s, cost});
      }
      continue;
    }
    for (int64_t a = r0; a < r1; a += kTileRows) {
      const int64_t e = std::min(a + kTileRows, r1);
      int64_t cost = 0;
      for (int64_t r = a; r < e; ++r) cost += p.pos[r] + 1;
      items.push_back({b, a, e, -1, cost});
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
  for (const Item& it : items) max_rows = std::max(max_rows, it.row_end - it.row_begin);
  std::vector<float> partials(num_partials * p.num_heads * (D + 2));
  std::atomic<int64_t> next{0};
  const int64_t num_items = static_cast<int64_t>(items.size());
  at::parallel_for(0, std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), num_items)), 1,
                   [&](int64_t, int64_t) {
                     Work w(p, max_rows * p.num_heads);
                     for (int64_t i = next++; i < num_items; i = next++)
                       run_item<D>(p, reader, w, items[i], q, out, partials.data(), partial_base.data());
                   });
  if (num_partials == 0) return;
  at::parallel_for(0, p.num_rows, 1, [&](int64_t first, int64_t last) {
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

Problem make_problem(const at::Tensor& query, int64_t h_kv, int64_t block_size, const at::Tensor& block_tables,
                     const at::Tensor& seq_lens, const at::Tensor& row_start, const at::Tensor& positions,
                     double scale) {
  TORCH_CHECK(query.device().is_cpu() && query.dim() == 3 && query.is_contiguous(),
              "query must be a contiguous CPU tensor [num_rows, num_heads, head_dim]");
  auto int_vector = [](const at::Tensor& t, const char* name, int64_t dim) {
    TORCH_CHECK(t.device().is_cpu() && t.scalar_type() == at::kInt && t.dim() == dim && t.is_contiguous(), name,
                " must be a contiguous int32 CPU tensor with ", dim, " dimension(s)");
  };
  int_vector(block_tables, "block_tables", 2);
  int_vector(seq_lens, "seq_lens", 1);
  int_vector(row_start, "query_start_loc", 1);
  int_vector(positions, "positions", 1);
  Problem p{};
  p.num_rows = query.size(0);
  p.num_heads = query.size(1);
  p.d = query.size(2);
  p.h_kv = h_kv;
  p.block_size = block_size;
  TORCH_CHECK(block_size >= 1 && (block_size & (block_size - 1)) == 0, "block_size must be a power of two");
  p.step_tokens = std::max(kStepTokens, block_size);
  p.split_tokens = std::max(kSplitTokens, p.step_tokens);
  p.num_seqs = seq_lens.size(0);
  TORCH_CHECK(h_kv >= 1 && p.num_heads % h_kv == 0, "num_heads must be a multiple of num_kv_heads");
  TORCH_CHECK(block_tables.size(0) == p.num_seqs && row_start.size(0) == p.num_seqs + 1,
              "block_tables, seq_lens and query_start_loc need one row per sequence (query_start_loc one more)");
  p.max_blocks = block_tables.size(1);
  p.scale = static_cast<float>(scale);
  p.block_tables = block_tables.data_ptr<int32_t>();
  p.seq_lens = seq_lens.data_ptr<int32_t>();
  p.row_start = row_start.data_ptr<int32_t>();
  TORCH_CHECK(p.row_start[0] == 0 && p.row_start[p.num_seqs] == p.num_rows,
              "query_start_loc must run from 0 to the number of query rows");
  const bool explicit_positions = positions.numel() > 0;
  TORCH_CHECK(!explicit_positions || positions.size(0) == p.num_rows, "positions need one entry per query row");
  const int32_t* given = explicit_positions ? positions.data_ptr<int32_t>() : nullptr;
  p.pos.resize(p.num_rows);
  for (int64_t b = 0; b < p.num_seqs; ++b) {
    const int64_t r0 = p.row_start[b], r1 = p.row_start[b + 1], len = p.seq_lens[b];
    TORCH_CHECK(r0 <= r1, "query_start_loc must not decrease");
    TORCH_CHECK(len >= r1 - r0 && len <= p.max_blocks * block_size, "seq_lens[", b, "] = ", len,
                " is outside [query rows, max_blocks * block_size]");
    for (int64_t r = r0; r < r1; ++r) {
      p.pos[r] = given ? given[r] : static_cast<int32_t>(len - (r1 - r));
      TORCH_CHECK(p.pos[r] >= 0 && p.pos[r] < len, "position ", p.pos[r], " of row ", r, " is outside [0, seq_lens[",
                  b, "])");
    }
    const int64_t blocks_used = (len + block_size - 1) / block_size;
    for (int64_t i = 0; i < blocks_used; ++i) {
      TORCH_CHECK(p.block_tables[b * p.max_blocks + i] >= 0, "block_tables[", b, ", ", i, "] is negative");
    }
  }
  return p;
}

void check_pool(const at::Tensor& t, const char* name, at::ScalarType dtype, int64_t dim) {
  TORCH_CHECK(t.device().is_cpu(), name, " must be a CPU tensor");
  TORCH_CHECK(t.scalar_type() == dtype, name, " must be ", dtype, ", got ", t.scalar_type());
  TORCH_CHECK(t.dim() == dim && t.is_contiguous(), name, " must be a contiguous ", dim, "-d tensor");
}

void check_block_ids(const Problem& p, int64_t num_blocks) {
  for (int64_t b = 0; b < p.num_seqs; ++b) {
    const int64_t blocks_used = (p.seq_lens[b] + p.block_size - 1) / p.block_size;
    for (int64_t i = 0; i < blocks_used; ++i) {
      TORCH_CHECK(p.block_tables[b * p.max_blocks + i] < num_blocks, "block_tables[", b, ", ", i,
                  "] is past the pool");
    }
  }
}

// q in fp32, pre-scaled; the kernel; out in the query's dtype.
template <typename Reader>
at::Tensor run(const Problem& p, const Reader& reader, const at::Tensor& query) {
  const RunFn<Reader> fn = run_for_head_dim<Reader>(p.d);
  at::Tensor q = query.to(at::kFloat).mul(p.scale).contiguous();  // one rounding per element, any dtype
  at::Tensor out = at::empty_like(q);
  fn(p, reader, q.data_ptr<float>(), out.data_ptr<float>());
  return out.to(query.scalar_type());
}

template <typename T>
at::Tensor run_dense(const Problem& p, const at::Tensor& k_cache, const at::Tensor& v_cache, const at::Tensor& query) {
  DenseReader<T> reader{k_cache.data_ptr<T>(), v_cache.data_ptr<T>(), p.block_size, p.h_kv, p.d};
  return run(p, reader, query);
}

at::Tensor paged_attention_dense(const at::Tensor& query, const at::Tensor& k_cache, const at::Tensor& v_cache,
                                 const at::Tensor& block_tables, const at::Tensor& seq_lens,
                                 const at::Tensor& query_start_loc, const at::Tensor& positions, double scale) {
  check_pool(k_cache, "k_cache", k_cache.scalar_type(), 4);
  check_pool(v_cache, "v_cache", k_cache.scalar_type(), 4);
  TORCH_CHECK(k_cache.sizes() == v_cache.sizes(), "k_cache and v_cache shapes differ");
  TORCH_CHECK(k_cache.size(3) == query.size(2), "head_dim of query and pool differ");
  const Problem p = make_problem(query, k_cache.size(2), k_cache.size(1), block_tables, seq_lens, query_start_loc,
                                 positions, scale);
  check_block_ids(p, k_cache.size(0));
  switch (k_cache.scalar_type()) {
    case at::kFloat: return run_dense<float>(p, k_cache, v_cache, query);
    case at::kBFloat16: return run_dense<at::BFloat16>(p, k_cache, v_cache, query);
    case at::kHalf: return run_dense<at::Half>(p, k_cache, v_cache, query);
    default: TORCH_CHECK(false, "k_cache must be float32, bfloat16 or float16, got ", k_cache.scalar_type());
  }
}

at::Tensor paged_attention_fp8(const at::Tensor& query, const at::Tensor& k_codes, const at::Tensor& v_codes,
                               const at::Tensor& k_scale, const at::Tensor& v_scale, const at::Tensor& block_tables,
                               const at::Tensor& seq_lens, const at::Tensor& query_start_loc,
                               const at::Tensor& positions, double scale) {
  check_pool(k_codes, "k_codes", at::kByte, 4);
  check_pool(v_codes, "v_codes", at::kByte, 4);
  check_pool(k_scale, "k_scale", at::kFloat, 3);
  check_pool(v_scale, "v_scale", at::kFloat, 3);
  TORCH_CHECK(k_codes.sizes() == v_codes.sizes() && k_codes.size(3) == query.size(2), "fp8 code shapes differ");
  TORCH_CHECK(k_scale.sizes() == k_codes.sizes().slice(0, 3) && v_scale.sizes() == k_scale.sizes(),
              "fp8 scales must be [num_blocks, block_size, num_kv_heads]");
  const Problem p = make_problem(query, k_codes.size(2), k_codes.size(1), block_tables, seq_lens, query_start_loc,
                                 positions, scale);
  check_block_ids(p, k_codes.size(0));
  Fp8Reader reader{k_codes.data_ptr<uint8_t>(), v_codes.data_ptr<uint8_t>(), k_scale.data_ptr<float>(),
                   v_scale.data_ptr<float>(), p.block_size, p.h_kv, p.d};
  return run(p, reader, query);
}

template <typename S>
at::Tensor run_int8(const Problem& p, const at::Tensor& k_codes, const at::Tensor& k_scale, const at::Tensor& k_zero,
                    const at::Tensor& shadow, const int32_t* slots, const at::Tensor& v_codes,
                    const at::Tensor& v_scale, const at::Tensor& v_zero, const at::Tensor& query) {
  Int8KiviReader<S> reader{k_codes.data_ptr<uint8_t>(), k_scale.data_ptr<at::Half>(), k_zero.data_ptr<at::Half>(),
                           shadow.data_ptr<S>(), slots, v_codes.data_ptr<uint8_t>(), v_scale.data_ptr<at::Half>(),
                           v_zero.data_ptr<at::Half>(), p.block_size, p.h_kv, p.d, p.d / v_scale.size(3)};
  return run(p, reader, query);
}

at::Tensor paged_attention_int8(const at::Tensor& query, const at::Tensor& k_codes, const at::Tensor& k_scale,
                                const at::Tensor& k_zero, const at::Tensor& shadow, const at::Tensor& slot_of_block,
                                const at::Tensor& v_codes, const at::Tensor& v_scale, const at::Tensor& v_zero,
                                const at::Tensor& block_tables, const at::Tensor& seq_lens,
                                const at::Tensor& query_start_loc, const at::Tensor& positions, double scale) {
  check_pool(k_codes, "k_codes", at::kByte, 4);
  check_pool(v_codes, "v_codes", at::kByte, 4);
  check_pool(k_scale, "k_scale", at::kHalf, 3);
  check_pool(k_zero, "k_zero", at::kHalf, 3);
  check_pool(v_scale, "v_scale", at::kHalf, 4);
  check_pool(v_zero, "v_zero", at::kHalf, 4);
  check_pool(shadow, "shadow", shadow.scalar_type(), 4);
  check_pool(slot_of_block, "slot_of_block", at::kInt, 1);
  const int64_t num_blocks = k_codes.size(0), d = k_codes.size(3);
  TORCH_CHECK(k_codes.sizes() == v_codes.sizes() && d == query.size(2), "int8 code shapes differ");
  TORCH_CHECK(k_scale.size(0) == num_blocks && k_scale.size(2) == d && k_zero.sizes() == k_scale.sizes(),
              "int8 K scale / zero must be [num_blocks, num_kv_heads, head_dim]");
  TORCH_CHECK(slot_of_block.size(0) == num_blocks, "slot_of_block must have one entry per block");
  TORCH_CHECK(v_scale.sizes() == v_zero.sizes() && v_scale.size(3) >= 1 && d % v_scale.size(3) == 0,
              "int8 V scale / zero must be [num_blocks, block_size, num_kv_heads, groups]");
  TORCH_CHECK(shadow.size(0) == 0 || shadow.sizes().slice(1) == k_codes.sizes().slice(1),
              "the open-block shadow must be [capacity, block_size, num_kv_heads, head_dim]");
  const Problem p = make_problem(query, k_codes.size(2), k_codes.size(1), block_tables, seq_lens, query_start_loc,
                                 positions, scale);
  check_block_ids(p, num_blocks);
  const int32_t* slots = slot_of_block.data_ptr<int32_t>();
  for (int64_t i = 0; i < num_blocks; ++i) {
    TORCH_CHECK(slots[i] < shadow.size(0), "slot_of_block[", i, "] = ", slots[i], " is past the shadow pool");
  }
  switch (shadow.scalar_type()) {
    case at::kFloat: return run_int8<float>(p, k_codes, k_scale, k_zero, shadow, slots, v_codes, v_scale, v_zero, query);
    case at::kBFloat16:
      return run_int8<at::BFloat16>(p, k_codes, k_scale, k_zero, shadow, slots, v_codes, v_scale, v_zero, query);
    case at::kHalf: return run_int8<at::Half>(p, k_codes, k_scale, k_zero, shadow, slots, v_codes, v_scale, v_zero, query);
    default: TORCH_CHECK(false, "shadow must be float32, bfloat16 or float16, got ", shadow.scalar_type());
  }
}

}  // namespace

// csrc/cpu/linear_cpu.cpp
at::Tensor pack_linear_weight(const at::Tensor& weight);
at::Tensor row_linear(const at::Tensor& x, const at::Tensor& packed, const c10::optional<at::Tensor>& bias,
                      int64_t out_features);

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("paged_attention_dense", &paged_attention_dense, "causal attention of any rows over a dense paged pool");
  m.def("paged_attention_fp8", &paged_attention_fp8, "the same over an fp8_e4m3 paged pool, read in place");
  m.def("paged_attention_int8", &paged_attention_int8, "the same over an int8 KIVI paged pool, read in place");
  m.def("pack_linear_weight", &pack_linear_weight, "W [out, in] -> the panels row_linear reads");
  m.def("row_linear", &row_linear, "x W^T (+ b) in fp32 over packed W, each row independent of the others");
}
