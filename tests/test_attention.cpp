// The CPU backend's attention kernels: the portable form (detail::) against the AVX2 form, bit for
// bit. The op's contract on every backend (references, documents, chunks, query segments, thread
// counts) is tested by the op harness: tests/ops/attention.cpp.
#include <gtest/gtest.h>

#include <limits>
#include <vector>

#include "lockstep/kernels/cpu/attention.h"
#include "ops/attention_testing.h"
#include "testing.h"

namespace lockstep {
namespace {

using namespace attention_testing;

struct Result {
  std::vector<float> out, lse, dqkv;
};

// Forward then backward with dout, the vector kernels or the portable ones; dqkv starts as NaN so
// that anything not assigned shows.
Result run(const std::vector<float>& qkv, const std::vector<float>& dout, const Dims& d, bool portable,
           const DocStarts& ds = {}, int64_t query_segments = 0) {
  const int32_t* doc = ds.empty() ? nullptr : ds.data();
  Result r;
  r.out.assign(static_cast<size_t>(d.out_size()), 0.0f);
  r.lse.assign(static_cast<size_t>(d.lse_size()), 0.0f);
  r.dqkv.assign(static_cast<size_t>(d.qkv_size()), std::numeric_limits<float>::quiet_NaN());
  if (portable) {
    detail::attention_forward_portable(r.out.data(), r.lse.data(), qkv.data(), d.B, d.T, d.NH, d.NKV, d.HS, doc);
    detail::attention_backward_portable(r.dqkv.data(), dout.data(), qkv.data(), r.out.data(), r.lse.data(), d.B, d.T,
                                        d.NH, d.NKV, d.HS, doc, query_segments);
  } else {
    attention_forward(r.out.data(), r.lse.data(), qkv.data(), d.B, d.T, d.NH, d.NKV, d.HS, doc);
    attention_backward(r.dqkv.data(), dout.data(), qkv.data(), r.out.data(), r.lse.data(), d.B, d.T, d.NH, d.NKV, d.HS,
                       doc, query_segments);
  }
  return r;
}

void expect_same(const Result& fast, const Result& portable, const std::string& what) {
  EXPECT_TRUE(testing::bitwise_equal(fast.out, portable.out, "out " + what));
  EXPECT_TRUE(testing::bitwise_equal(fast.lse, portable.lse, "lse " + what));
  EXPECT_TRUE(testing::bitwise_equal(fast.dqkv, portable.dqkv, "dqkv " + what));
}

TEST(Attention, PortableMatchesVectorBitwise) {
  const Dims shapes[] = {{2, 67, 4, 2, 12}, {1, 130, 2, 1, 64}};
  for (const Dims& d : shapes) {
    const std::vector<float> qkv = inputs(d, 5), dout = out_grad(d, 5);
    expect_same(run(qkv, dout, d, false), run(qkv, dout, d, true), name(d));
  }
}

// Packed documents (the layouts of the harness's document cases); the thread counts:
// HarnessAttentionDocuments.BitwiseAcrossThreadsAndPortable.
TEST(AttentionDocuments, PortableMatchesVectorBitwise) {
  const Dims d{5, 200, 4, 2, 12};
  const DocStarts ds = doc_starts(d, layouts());
  const std::vector<float> qkv = inputs(d, 10), dout = out_grad(d, 10);
  expect_same(run(qkv, dout, d, false, ds), run(qkv, dout, d, true, ds), "portable");
}

// The backward in query segments (determinism = "layout"): the portable form's bits; the rest of
// the contract: HarnessAttentionChunks.QuerySegmentsAreTheTreeOverSegmentsAndSplitOverCpRanks.
TEST(AttentionChunks, QuerySegmentsPortableMatchesVectorBitwise) {
  struct Case {
    Dims d;
    int64_t G;
    bool docs;
  };
  const Case cases[] = {{{2, 64, 4, 2, 16}, 8, false},
                        {{1, 128, 4, 1, 12}, 8, false},
                        {{2, 96, 2, 2, 8}, 8, true},
                        {{1, 256, 2, 1, 16}, 16, false},
                        {{1, 40, 2, 2, 8}, 8, true}};
  for (const Case& c : cases) {
    const DocStarts ds = c.docs ? doc_starts(c.d, layouts()) : DocStarts{};
    const std::vector<float> qkv = inputs(c.d, 21), dout = out_grad(c.d, 21);
    expect_same(run(qkv, dout, c.d, false, ds, c.G), run(qkv, dout, c.d, true, ds, c.G), name(c.d) + str(" G=", c.G));
  }
}

}  // namespace
}  // namespace lockstep
