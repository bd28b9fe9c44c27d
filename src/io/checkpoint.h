// Weights and batches for tpsim's models as safetensors files, so users can load the same
// files in PyTorch (safetensors.torch.load_file) and compare. Names and shapes are those
// of ParamSpec (PyTorch's: Linear weights [out,in]).
//
// Loading is strict: every defect is a one-line UsageError naming the file and tensor.
// Saving checks its inputs against the specs and throws Error on a mismatch: a caller bug,
// not a user's.
#pragma once

#include <map>
#include <string>
#include <vector>

#include "core/dtype.h"
#include "io/safetensors.h"
#include "model/config.h"

namespace tpsim {

// A weights file's tensors as its header declares them, by name: what can be checked
// against a config before a byte of a tensor is read.
struct DeclaredTensor {
  DType dtype;
  Shape shape;
};
using WeightsHeader = std::map<std::string, DeclaredTensor>;
WeightsHeader header_of(const std::vector<st::StEntry>& entries);
// UsageError, naming `source` and the tensor, unless `header` declares exactly the names of
// `specs`, each F32, F64 or BF16 of its spec's shape.
void check_weights_header(const WeightsHeader& header, const std::vector<ParamSpec>& specs,
                          const std::string& source);

// Weights for a model: exactly the names and shapes of `specs`, each F32, F64 or BF16, every
// value finite. Returns full (unsharded) row-major values by name, widened to double.
// load_weights checks the file's header (check_weights_header) before it reads a tensor.
std::map<std::string, std::vector<double>> load_weights(const std::string& path,
                                                        const std::vector<ParamSpec>& specs);
// The same checks on a file already parsed; `source` names it in messages.
std::map<std::string, std::vector<double>> weights_from_st(const st::StFile& file,
                                                           const std::vector<ParamSpec>& specs,
                                                           const std::string& source);

// Writes exactly `specs` from `values` (each numel(shape) finite values) as F32 or F64,
// with metadata {"format": "pt"} (what Hugging Face loaders expect of torch weights).
void save_weights(const std::string& path, const std::vector<ParamSpec>& specs,
                  const std::map<std::string, std::vector<double>>& values, DType as);
st::StFile weights_to_st(const std::vector<ParamSpec>& specs,
                         const std::map<std::string, std::vector<double>>& values, DType as);

// A batch: input_ids I64 [B,T] and labels I64 [B,T-1], nothing else; B >= 1, T >= 2.
// Ids are not checked against a vocabulary here: check_gpt_batch does that with the config.
GptBatch load_gpt_batch(const std::string& path);
GptBatch gpt_batch_from_st(const st::StFile& file, const std::string& source);

void save_gpt_batch(const std::string& path, const GptBatch& batch);
st::StFile gpt_batch_to_st(const GptBatch& batch);

}  // namespace tpsim
