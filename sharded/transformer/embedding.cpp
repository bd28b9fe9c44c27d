#include "sharded/transformer/embedding.h"

#include "sharded/mappings.h"

namespace tpsim {

Embedding::Embedding(TransformerContext& c, Parameter& wte, Parameter* wpe, const Tensor& ids,
                     const Tensor& ids_all, const Tensor& pos, const Tensor& scratch)
    : c_(c), wte_(wte), wpe_(wpe), ids_(ids), ids_all_(ids_all), pos_(pos), demb_(scratch) {
  const std::int64_t H = c.cfg.hidden;
  x0_ = c.act({c.Nl, H}, "embedding.out");
  if (c.par.loss_parallel)
    emb_full_ = c.be.empty({c.N, H}, c.dtype, MemCategory::Temporary, "embedding.partial");
  if (wpe_) pos_emb_ = c.tmp({c.Nl, H}, "wpe.lookup");
}

void Embedding::forward() {
  c_.comm.set_label("embedding");
  if (c_.par.loss_parallel) {
    // Vocab-parallel lookup of every token: rows outside this rank's range are 0 ...
    c_.be.embedding_forward(emb_full_, ids_all_, wte_.value, vocab_row0());
    // ... and the sum over ranks completes them (reduce-scattered to tokens under SP).
    if (c_.sp) {
      reduce_scatter_to_sp_region_forward(c_.comm, x0_, emb_full_);
    } else {
      reduce_from_tp_region_forward(c_.comm, emb_full_);
      c_.be.copy(x0_, emb_full_);
    }
  } else {
    c_.be.embedding_forward(x0_, ids_, wte_.value, 0);
  }
  if (wpe_) {
    c_.be.embedding_forward(pos_emb_, pos_, wpe_->value, 0);
    c_.be.add_inplace(x0_, pos_emb_);
  }
  c_.be.dropout(x0_, c_.tokens_mask("dropout/embedding"));
}

void Embedding::backward(Tensor& dx, bool wte_chunked) {
  c_.snapshot(c_.bwd_snaps, "act/embedding.out.grad", dx);
  c_.comm.set_label("embedding");
  Backend& be = c_.be;
  be.dropout(dx, c_.tokens_mask("dropout/embedding"));  // dx is the embeddings' gradient now
  Reduction& red = *c_.red;
  if (red.canonical() && c_.sp) {
    // wpe's and (without loss parallel) wte's gradients sum over this rank's tokens: one
    // partial per token chunk, combined in chunk order.
    const CanonicalChunks& k = red.chunks();
    const int Cl = k.local();
    const std::int64_t n = red.sizes().Nc;
    Tensor none;
    if (wpe_) {
      const std::int64_t P = wpe_->value.dim(0), H = wpe_->value.dim(1);
      Tensor local = red.grad_partials().narrow0(0, Cl * P * H).reshape({Cl * P, H});
      Tensor all = red.grad_gathered().narrow0(0, k.C * P * H).reshape({k.C * P, H});
      for (int j = 0; j < Cl; ++j) {
        Tensor pj = local.narrow0(j * P, P);
        be.fill(pj, 0.0);
        be.embedding_backward(pj, dx.narrow0(j * n, n), pos_.narrow0(j * n, n), 0);
      }
      combine_partials(be, c_.comm, k, wpe_->grad, local, all, none, 0);
    }
    if (wte_chunked) {
      const std::int64_t V = wte_.value.dim(0);
      for (int j = 0; j < Cl; ++j) {
        Tensor pj = red.wte_partials().narrow0(j * V, V);
        be.embedding_backward(pj, dx.narrow0(j * n, n), ids_.narrow0(j * n, n), 0);
      }
      combine_partials(be, c_.comm, k, wte_.grad, red.wte_partials(), red.wte_gathered(), none, 0);
    }
  } else if (wpe_) {
    be.embedding_backward(wpe_->grad, dx, pos_, 0);
  }
  if (c_.par.loss_parallel) {
    const Tensor* demb = &dx;
    if (c_.sp) {  // the reduce-scatter's backward: all-gather the token gradients
      reduce_scatter_to_sp_region_backward(c_.comm, demb_, dx);
      demb = &demb_;
    }
    be.embedding_backward(wte_.grad, *demb, ids_all_, vocab_row0());
  } else if (!wte_chunked) {  // (chunked: added above)
    be.embedding_backward(wte_.grad, dx, ids_, 0);
  }
}

}  // namespace tpsim
