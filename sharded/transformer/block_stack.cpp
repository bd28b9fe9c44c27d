#include "sharded/transformer/block_stack.h"

namespace tpsim {

BlockStack::BlockStack(TransformerContext& c, const TpRegions& regions, std::vector<Parameter>& params,
                       std::map<std::string, Parameter>& fused,
                       const std::function<std::unique_ptr<MoeLayer>(std::size_t)>& moe)
    : c_(c), attn_ws_(c), mlp_ws_(c) {
  const std::int64_t H = c.cfg.hidden;
  if (c.sp) gathered_ = c.tmp({c.N, H}, "ln.out.gathered");
  const std::size_t n = chunk_layers();
  for (std::size_t l = 0; l < static_cast<std::size_t>(c.cfg.layers); ++l) {
    auto blk = std::make_unique<Block>(c, regions, attn_ws_, mlp_ws_, params, fused, l, moe(l));
    // Full recompute: the first chunk_layers() blocks own the activations, which every
    // chunk's blocks share (block l the slot l mod chunk_layers()); the others alias them.
    if (full() && l >= n) {
      blk->share_activations(*blocks_[l % n]);
      if (l % n == 0)  // a chunk's input, all it keeps
        chunk_in_.push_back(c.act({c.Nl, H}, "h." + std::to_string(l) + ".recompute.input"));
    } else {
      blk->allocate(l == 0 ? nullptr : blocks_[0].get(), gathered_);
    }
    blocks_.push_back(std::move(blk));
  }
  dres_[0] = c.tmp({c.Nl, H}, "residual.grad.0");
  dres_[1] = c.tmp({c.Nl, H}, "residual.grad.1");
  if (c.cfg.dropout > 0) dbranch_ = c.tmp({c.Nl, H}, "residual.branch.grad");
}

BlockStack::~BlockStack() = default;

std::size_t BlockStack::chunk_layers() const {
  return static_cast<std::size_t>(
      recompute_chunk_layers(c_.par.recompute, c_.par.recompute_layers, c_.cfg.layers));
}

const Tensor& BlockStack::block_input(std::size_t l) const {
  if (l == 0) return *x0_;
  const std::size_t n = chunk_layers();
  if (full() && l % n == 0) return chunk_in_[l / n - 1];
  return blocks_[l - 1]->out();
}

const Tensor& BlockStack::out() const { return blocks_.empty() ? *x0_ : blocks_.back()->out(); }

const Tensor& BlockStack::forward(const Tensor& x0, double& aux_loss) {
  x0_ = &x0;
  // Full recompute: each chunk's input kept, its blocks' activations not.
  for (std::size_t l = 0; l < blocks_.size(); ++l) {
    if (full() && l > 0 && l % chunk_layers() == 0)
      c_.be.copy(chunk_in_[l / chunk_layers() - 1], blocks_[l - 1]->out());
    blocks_[l]->forward(block_input(l), aux_loss);
  }
  return out();
}

void BlockStack::rerun_chunk(std::size_t last) {
  // The chunk's input is all it kept: its blocks run forward again from it, into the
  // activations that the chunk's backward reads. The counter-based masks draw the first
  // pass's dropout again (the fault draws fresh ones); under SP the all-gathers repeat.
  const std::size_t first = last / chunk_layers() * chunk_layers();
  c_.rerun = true;
  double aux_loss = 0.0;  // counted in the first pass
  for (std::size_t l = first; l <= last; ++l) blocks_[l]->forward(rerun_input(l, first), aux_loss);
  c_.rerun = false;
}

Tensor& BlockStack::backward() {
  Tensor* dx = &dres_[0];
  for (std::size_t li = blocks_.size(); li-- > 0;) {
    // Full recompute: at a chunk's last block, the chunk's forward again from its input.
    if (full() && (li + 1 == blocks_.size() || (li + 1) % chunk_layers() == 0)) rerun_chunk(li);
    Tensor* dx_prev = dx == &dres_[0] ? &dres_[1] : &dres_[0];
    blocks_[li]->backward(*dx_prev, *dx, block_input(li), dbranch_);
    dx = dx_prev;
  }
  return *dx;
}

void BlockStack::observe_forward(std::vector<Observation>& obs,
                                 const std::function<void(const std::string&, const Tensor&)>& add) {
  // A block's points: in its own buffers, or, where full recomputation shares them
  // between layers, as snapshotted in the first pass.
  const std::function<void(const std::string&, const Tensor&)> add_block =
      [&](const std::string& n, const Tensor& t) {
        if (full()) obs.push_back(c_.fwd_snaps.view(n));
        else add(n, t);
      };
  for (auto& b : blocks_) b->observe_forward(obs, add_block);
}

}  // namespace tpsim
