// Korthikanti et al. 2022 ("Reducing Activation Recomputation in Large Transformer
// Models"), Section 4 and Table 2, beside tpsim's own memory model (activation_model.h):
// the paper's activation bytes per layer for a configuration, term by term, and what
// tpsim keeps for each term.
//
// The paper counts 16-bit activations and 1-byte dropout masks per layer (s sequence, b
// micro-batch, h hidden, a heads, t TP degree):
//   LayerNorm inputs 4sbh, q/k/v input 2sbh, Q and K 4sbh, V 2sbh, softmax output 2as²b,
//   its dropout mask as²b and output 2as²b, the output projection's input 2sbh, the
//   attention dropout mask sbh, the MLP's input 2sbh, GeLU input 8sbh and output 8sbh,
//   the MLP dropout mask sbh: 34sbh + 5as²b.
// Under TP the LayerNorm inputs, the two Linear inputs and the two residual masks (10sbh)
// stay whole and the rest is split by t; sequence parallelism splits those too; selective
// recomputation drops the 5as²b terms; full recomputation keeps the layer's input, 2sbh.
#pragma once

#include <string>
#include <vector>

#include "profile/activation_model.h"

namespace tpsim {

// The paper's Table 2 row for a configuration: activation bytes per layer per rank.
// Full recomputation is 2sbh whatever t (the paper's table: the input is kept whole).
double paper_layer_bytes(double s, double b, double h, double a, double t, bool sequence_parallel,
                         RecomputeKind recompute);

struct LayerTerm {
  std::string term;      // the paper's name for the stored tensor
  double paper = 0;      // its bytes per layer per rank in the paper's counting
  double tpsim = 0;      // tpsim's bytes for it, per layer per rank, averaged over the layers
  std::string kept;      // what tpsim keeps for it, and at what element size
};

// The paper's terms for the query's configuration (its s, b, h, a, t, SP and recompute;
// the paper's 2-byte activations), and tpsim's activation tensors of the prediction `p`
// (of the same query) mapped onto them, per layer averaged over the layers. tpsim's
// tensors that the paper does not list (LayerNorm statistics, GQA's expanded kv heads)
// are terms of their own with paper = 0; under full recomputation the paper counts the
// layer input alone (2sbh, its own term) and a chunk's working set is booked under the
// ordinary terms, whose paper bytes are then 0. The embedding output (layer 0's input) is
// outside the layers, as in the memory model. The tpsim column sums to the prediction's
// activation bytes over the layers / L; a tensor no term claims throws Error, so the table
// cannot silently miss one.
std::vector<LayerTerm> layer_terms(const GptMemoryQuery& q, const GptMemoryPrediction& p);

// The paper's Table 3 configurations (s 2048, v 51200, TP 8): name, heads, hidden, layers,
// micro-batch.
struct PaperModel {
  const char* name;
  std::int64_t heads, hidden, layers, batch;
};
const std::vector<PaperModel>& paper_models();

}  // namespace tpsim
