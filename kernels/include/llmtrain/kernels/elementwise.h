// Helpers to read llmtrain/kernels/elementwise.def: LLMTRAIN_EW_LIST(F, (a, b)) is F(a), F(b) (up
// to four names), with F one of the parameter and argument forms below.
#pragma once

#define LLMTRAIN_EW_UNPAREN(...) __VA_ARGS__
#define LLMTRAIN_EW_MAP1(F, a) F(a)
#define LLMTRAIN_EW_MAP2(F, a, b) F(a), F(b)
#define LLMTRAIN_EW_MAP3(F, a, b, c) F(a), F(b), F(c)
#define LLMTRAIN_EW_MAP4(F, a, b, c, d) F(a), F(b), F(c), F(d)
#define LLMTRAIN_EW_PICK(_1, _2, _3, _4, NAME, ...) NAME
#define LLMTRAIN_EW_MAP(F, ...) \
  LLMTRAIN_EW_PICK(__VA_ARGS__, LLMTRAIN_EW_MAP4, LLMTRAIN_EW_MAP3, LLMTRAIN_EW_MAP2, LLMTRAIN_EW_MAP1)(F, __VA_ARGS__)
#define LLMTRAIN_EW_LIST(F, list) LLMTRAIN_EW_MAP(F, LLMTRAIN_EW_UNPAREN list)

// Parameters of the op (ops.h), of the CPU reference (float) and of the CUDA kernels (a template
// on the element type Act).
#define LLMTRAIN_EW_TENSOR(x) const Tensor& x
#define LLMTRAIN_EW_F32_OUT(x) float* x
#define LLMTRAIN_EW_F32_IN(x) const float* x
#define LLMTRAIN_EW_ACT_OUT(x) Act* x
#define LLMTRAIN_EW_ACT_IN(x) const Act* x
// Arguments, in the dispatch (ops.cpp).
#define LLMTRAIN_EW_ADDRESS(x) &x
#define LLMTRAIN_EW_VIEW_OUT(x) v.out(x)
#define LLMTRAIN_EW_VIEW_IN(x) v.in(x)
