#include "sharded/transformer/lm_head.h"

#include "sharded/mappings.h"

namespace tpsim {

LmHead::LmHead(TransformerContext& c, TpRegion& region, Parameter& ln_f, Parameter* ln_f_bias,
               Parameter& weight, Parameter& wte, const std::vector<std::int64_t>& targets,
               std::int64_t n_valid, std::unique_ptr<VocabParallelCrossEntropy> ce)
    : c_(c), region_(region), weight_(weight), wte_(wte), n_valid_(n_valid), ce_(std::move(ce)) {
  const bool lp = c.par.loss_parallel;
  // Logits rows: every token with loss parallel; this rank's tokens under SP without it.
  const bool rows_local = c.sp && !lp;
  const std::int64_t Nce = rows_local ? c.Nl : c.N, row0 = rows_local ? c.tok0 : 0;
  targets_ = c.be.empty({Nce}, DType::I64, MemCategory::Input, "targets");
  c.be.from_host_i64(targets_, targets.data() + row0);
  ln_f_.weight = &ln_f;
  ln_f_.bias = ln_f_bias;
  ln_f_.allocate(c, "ln_f");
  if (lp && c.sp) hf_full_ = c.act({c.N, c.cfg.hidden}, "ln_f.out.gathered");
  else hf_full_ = ln_f_.out;
  logits_ = c.act({Nce, weight.value.dim(0)}, "logits");
  ce_->col0 = lp ? weight.spec.offset : 0;
  ce_->valid = lp ? weight.spec.valid_length() : c.cfg.vocab_size;
  ce_->split = lp;
  dlogits_ = c.tmp(logits_.shape(), "logits.grad");
  if (c.red->canonical()) {
    ce_->canon = &c.red->chunks();
    ce_->tiles = &c.red->tiles();
  }
}

double LmHead::forward(const Tensor& x) {
  const bool sp = c_.sp, lp = c_.par.loss_parallel;
  c_.comm.set_label("head");
  ln_f_.forward(c_, x);
  if (lp) {
    if (sp) region_.gather_tokens(hf_full_, ln_f_.out);
    else (void)copy_to_tp_region_forward(ln_f_.out);  // identity: hf_full_ aliases hf
  }
  // Canonical tiles: vocabulary columns (loss parallel), or this rank's tokens (SP alone).
  const Reduction::Sizes& z = c_.red->sizes();
  c_.red->gemm(logits_, hf_full_, false, weight_.value, true, {sp && !lp ? z.Nc : 0, lp ? z.Vc : 0});
  c_.comm.set_label("cross_entropy");
  return ce_->forward(c_.be, c_.comm, logits_, targets_, n_valid_, /*rows_split=*/sp && !lp);
}

void LmHead::backward(Tensor& dx, const Tensor& x, bool wte_chunked) {
  const bool sp = c_.sp, lp = c_.par.loss_parallel;
  Backend& be = c_.be;
  Reduction& red = *c_.red;
  const Reduction::Sizes& z = red.sizes();
  c_.comm.set_label("head");
  ce_->backward(be, dlogits_, logits_, targets_, n_valid_);
  if (wte_chunked) {
    const std::int64_t V = wte_.value.dim(0), n = z.Nc;
    for (int j = 0; j < red.chunks().local(); ++j) {
      Tensor pj = red.wte_partials().narrow0(j * V, V);  // [V,H]
      chunk_weight_grad(pj, dlogits_.narrow0(j * n, n), hf_full_.narrow0(j * n, n));
    }
    if (!c_.cfg.tied_embeddings) {
      // An untied head's gradient is complete: combined now, in the same buffers, which
      // then start again from zero for the embedding's share of wte's.
      Tensor none;
      combine_partials(be, c_.comm, red.chunks(), weight_.grad, red.wte_partials(),
                       red.wte_gathered(), none, 0);
      be.fill(red.wte_partials(), 0.0);
    }
  } else {
    weight_grad(dlogits_, hf_full_, {lp ? z.Vc : 0, 0});  // its first writer
  }
  Tensor dhf;  // [Nl,H] gradient of ln_f's output
  if (lp) {
    // The logits are split by vocabulary: each rank's dhf is a share; f's backward sums.
    red.split_product(region_.input_grad(), dlogits_, false, weight_.value, false, z.Vc);
    dhf = region_.enter_backward();
  } else {
    dhf = region_.input_grad().narrow0(0, c_.Nl);  // this rank's logits rows are its own tokens
    red.gemm(dhf, dlogits_, false, weight_.value, false, {sp ? z.Nc : 0, 0});
  }
  c_.snapshot(c_.bwd_snaps, "act/ln_f.out.grad", dhf);
  be.fill(dx, 0.0);
  ln_f_.backward(c_, dx, dhf, x);
}

}  // namespace tpsim
