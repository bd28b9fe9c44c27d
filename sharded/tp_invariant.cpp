#include "sharded/tp_invariant.h"

#include <vector>

#include "core/errors.h"

namespace tpsim {

void combine_partials(Backend& be, Communicator& comm, const CanonicalChunks& k, Tensor& out,
                      const Tensor& local, Tensor& gathered, Tensor& acc, std::int64_t row0,
                      CombineOrder order) {
  const std::int64_t n = local.dim(0) / k.local(), R = out.dim(0);
  if (n * k.local() != local.dim(0) || row0 + R > n)
    throw Error("combine_partials: '" + local.tag() + "' " + shape_str(local.shape()) +
                " is not " + std::to_string(k.local()) + " chunks holding rows [" +
                std::to_string(row0) + "," + std::to_string(row0 + R) + ") of '" + out.tag() + "'");
  // Which partial, by its row block in `all`, is added at each position of the sum.
  std::vector<int> blocks;
  const Tensor* all = &local;
  if (order == CombineOrder::OwnOnly) {
    for (int j = 0; j < k.local(); ++j) blocks.push_back(j);
  } else {
    if (k.world > 1) {
      comm.all_gather(local, gathered);  // rank r's chunks land at blocks [r·C/t, (r+1)·C/t)
      all = &gathered;
    }
    const int start = order == CombineOrder::FromOwnRank ? k.first() : 0;
    for (int c = 0; c < k.C; ++c) blocks.push_back((start + c) % k.C);
  }
  Tensor& sum = out.dtype() == local.dtype() ? out : acc;
  for (std::size_t i = 0; i < blocks.size(); ++i) {
    const Tensor p = all->narrow0(blocks[i] * n + row0, R);
    if (i == 0) be.copy(sum, p);
    else be.add_inplace(sum, p);
  }
  if (&sum != &out) be.copy(out, sum);
}

struct Reduction::Canonical {
  Canonical(Backend& be, int r, int t) : cg(be) {
    k.rank = r;
    k.world = t;
  }
  CanonicalChunks k;
  CanonicalGemm cg;
  Tensor local;     // [C/t·N,H]  this rank's partials of a split reduction (compute dtype)
  Tensor gathered;  // [C·N,H]    every rank's (tp > 1)
  Tensor acc;       // [N,H]      the f32 sum of a bf16 output, rounded once
  Tensor grad_local, grad_gathered;  // [C/t·G], [C·G]
  Tensor wte_local, wte_gathered;    // [C/t·V,H], [C·V,H]
};

Reduction::Reduction(Backend& be, Communicator& comm) : be_(be), comm_(comm) {}
Reduction::~Reduction() = default;

std::unique_ptr<Reduction> Reduction::plain(Backend& be, Communicator& comm) {
  return std::unique_ptr<Reduction>(new Reduction(be, comm));
}

std::unique_ptr<Reduction> Reduction::canonical(Backend& be, Communicator& comm, DType dtype,
                                                const Sizes& sizes, std::int64_t rows,
                                                std::int64_t width, std::int64_t grad_width,
                                                std::int64_t wte_rows) {
  std::unique_ptr<Reduction> red(new Reduction(be, comm));
  red->sizes_ = sizes;
  red->canon_ = std::make_unique<Canonical>(be, comm.rank(), comm.world_size());
  Canonical& v = *red->canon_;
  const int C = v.k.C, Cl = v.k.local();
  const DType cd = compute_dtype(dtype);
  v.local = be.empty({Cl * rows, width}, cd, MemCategory::Temporary, "invariant.partials");
  if (v.k.world > 1)
    v.gathered = be.empty({C * rows, width}, cd, MemCategory::CommBuffer, "invariant.gathered");
  if (cd != dtype) v.acc = be.empty({rows, width}, cd, MemCategory::Temporary, "invariant.sum");
  if (grad_width > 0) {
    v.grad_local = be.empty({Cl * grad_width}, cd, MemCategory::Temporary, "invariant.grad.partials");
    v.grad_gathered =
        be.empty({C * grad_width}, cd, MemCategory::CommBuffer, "invariant.grad.gathered");
  }
  if (wte_rows > 0) {
    v.wte_local = be.empty({Cl * wte_rows, width}, cd, MemCategory::Temporary, "invariant.wte.partials");
    v.wte_gathered =
        be.empty({C * wte_rows, width}, cd, MemCategory::CommBuffer, "invariant.wte.gathered");
  }
  return red;
}

Reduction::Canonical& Reduction::canon() const {
  if (!canon_) throw Error("Reduction: a canonical workspace asked of the plain policy");
  return *canon_;
}

const CanonicalChunks& Reduction::chunks() const { return canon().k; }
CanonicalGemm& Reduction::tiles() { return canon().cg; }
Tensor& Reduction::local() { return canon().local; }
Tensor& Reduction::grad_partials() { return canon().grad_local; }
Tensor& Reduction::grad_gathered() { return canon().grad_gathered; }
Tensor& Reduction::wte_partials() { return canon().wte_local; }
Tensor& Reduction::wte_gathered() { return canon().wte_gathered; }

void Reduction::gemm(Tensor& out, const Tensor& a, bool trans_a, const Tensor& b, bool trans_b,
                     GemmTiles tiles) {
  if (canon_) canon_->cg.gemm(out, a, trans_a, b, trans_b, tiles);
  else be_.gemm(out, a, trans_a, b, trans_b);
}

void Reduction::split_product(Tensor& out, const Tensor& a, bool trans_a, const Tensor& b,
                              bool trans_b, std::int64_t kc, int tile0, double beta,
                              std::int64_t second_k0) {
  if (!canon_) return be_.gemm(out, a, trans_a, b, trans_b, 1.0, beta);
  Canonical& v = *canon_;
  const std::int64_t rows = trans_a ? a.dim(1) : a.dim(0);
  for (int j = 0; j < v.k.local(); ++j) {
    Tensor pj = v.local.narrow0(j * rows, rows);  // [rows,width]
    v.cg.gemm_k_chunk(pj, a, trans_a, b, trans_b, (tile0 + j) * kc, kc, beta);
    if (second_k0 >= 0)
      v.cg.gemm_k_chunk(pj, a, trans_a, b, trans_b, second_k0 + j * kc, kc, 1.0);
  }
}

void Reduction::combine(Tensor& out, std::int64_t row0, CombineOrder order) {
  Canonical& v = canon();
  Tensor acc = v.acc.defined() ? v.acc.narrow0(0, out.dim(0)) : Tensor{};
  combine_partials(be_, comm_, v.k, out, v.local, v.gathered, acc, row0, order);
}

void Reduction::token_chunk_sum(Tensor& grad, bool own_only,
                                const std::function<void(Tensor&, std::int64_t, std::int64_t)>& add) {
  Canonical& v = canon();
  const int Cl = v.k.local();
  const std::int64_t G = grad.numel(), n = sizes_.Nc;
  Tensor local = v.grad_local.narrow0(0, Cl * G).reshape({Cl, G});          // [C/t,G]
  Tensor all = v.grad_gathered.narrow0(0, v.k.C * G).reshape({v.k.C, G});  // [C,G]
  for (int j = 0; j < Cl; ++j) {
    Tensor pj = local.narrow0(j, 1).reshape({G});
    be_.fill(pj, 0.0);
    add(pj, j * n, n);
  }
  Tensor out = grad.reshape({1, G}), none;
  combine_partials(be_, comm_, v.k, out, local, all, none, 0,
                   own_only ? CombineOrder::OwnOnly : CombineOrder::Canonical);
}

}  // namespace tpsim
