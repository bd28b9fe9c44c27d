#include "io/checkpoint.h"

#include <cmath>
#include <set>

namespace tpsim {

namespace {

using st::quote_name;
using st::StFile;
using st::StTensor;

[[noreturn]] void fail(const std::string& source, const std::string& what) {
  throw UsageError(source + ": " + what);
}

[[noreturn]] void fail_tensor(const std::string& source, const std::string& name,
                              const std::string& what) {
  fail(source, "tensor " + quote_name(name) + ": " + what);
}

std::string plural(std::size_t n, const char* word) {
  return std::to_string(n) + " " + word + (n == 1 ? "" : "s");
}

std::string value_str(double v) {
  if (std::isnan(v)) return "NaN";
  return v > 0 ? "+Inf" : "-Inf";
}

// ---------------------------------------------------------------------------------------
// Weights.

// Names in the file that no spec has, in name order.
std::vector<std::string> unknown_names(const WeightsHeader& file, const std::vector<ParamSpec>& specs) {
  std::set<std::string> wanted;
  for (const auto& s : specs) wanted.insert(s.name);
  std::vector<std::string> out;
  for (const auto& [name, t] : file)
    if (!wanted.count(name)) out.push_back(name);
  return out;
}

// Missing tensors first, in spec order: with a renamed tensor, the name the config wants
// is the more useful one to print, and the unknown name in the file is the hint.
void check_weight_names(const WeightsHeader& file, const std::vector<ParamSpec>& specs,
                        const std::string& source) {
  const auto extra = unknown_names(file, specs);
  for (const auto& spec : specs) {
    if (file.count(spec.name)) continue;
    std::string hint = extra.empty() ? std::string()
                                     : "; the file has " + plural(extra.size(), "tensor") +
                                           " the config does not know, e.g. " + quote_name(extra[0]);
    fail_tensor(source, spec.name,
                "missing; the config needs shape " + shape_str(spec.shape) + hint);
  }
  if (!extra.empty())
    fail_tensor(source, extra[0],
                "not a parameter of this model (the config has " +
                    plural(specs.size(), "parameter") + "; the file has " +
                    plural(extra.size(), "tensor") + " too many)");
}

void check_declared_weight(const DeclaredTensor& t, const ParamSpec& spec, const std::string& source) {
  if (t.dtype != DType::F32 && t.dtype != DType::F64 && t.dtype != DType::BF16)
    fail_tensor(source, spec.name, std::string("dtype ") + st::st_dtype_name(t.dtype) +
                                       ", but weights must be F32, F64 or BF16");
  if (t.shape != spec.shape)
    fail_tensor(source, spec.name, "shape " + shape_str(t.shape) +
                                       " but the config needs " + shape_str(spec.shape));
}

std::vector<double> checked_weight(const StTensor& t, const ParamSpec& spec,
                                   const std::string& source) {
  check_declared_weight({t.dtype, t.shape}, spec, source);
  std::vector<double> v = t.to_f64();
  for (std::size_t i = 0; i < v.size(); ++i)
    if (!std::isfinite(v[i]))
      fail_tensor(source, spec.name, "value at flat index " + std::to_string(i) + " is " +
                                         value_str(v[i]) + "; weights must be finite");
  return v;
}

// The values for `spec`, checked before anything is written: the count, finiteness, and
// (for F32) that rounding does not overflow to Inf.
const std::vector<double>& checked_values(const std::map<std::string, std::vector<double>>& values,
                                          const ParamSpec& spec, DType as) {
  auto it = values.find(spec.name);
  if (it == values.end()) throw Error("save_weights: no values for '" + spec.name + "'");
  const auto& v = it->second;
  if (static_cast<std::int64_t>(v.size()) != shape_numel(spec.shape))
    throw Error("save_weights: '" + spec.name + "' has " + std::to_string(v.size()) +
                " values but shape " + shape_str(spec.shape) + " needs " +
                std::to_string(shape_numel(spec.shape)));
  for (std::size_t i = 0; i < v.size(); ++i) {
    bool finite = std::isfinite(v[i]) && (as != DType::F32 || std::isfinite(static_cast<float>(v[i])));
    if (!finite)
      throw Error("save_weights: '" + spec.name + "' value at flat index " + std::to_string(i) +
                  " is " + std::to_string(v[i]) + ", not finite as " + st::st_dtype_name(as) +
                  "; load_weights would refuse the file");
  }
  return v;
}

// ---------------------------------------------------------------------------------------
// Batches.

const char* const kBatchLayout = "a batch holds exactly input_ids I64 [B,T] and labels I64 [B,T-1]";

const StTensor& batch_tensor(const StFile& file, const char* name, const std::string& source) {
  auto it = file.tensors.find(name);
  if (it == file.tensors.end()) fail_tensor(source, name, std::string("missing; ") + kBatchLayout);
  const StTensor& t = it->second;
  if (t.dtype != DType::I64)
    fail_tensor(source, name, std::string("dtype ") + st::st_dtype_name(t.dtype) +
                                  ", but token ids and labels must be I64");
  if (t.shape.size() != 2)
    fail_tensor(source, name, "shape " + shape_str(t.shape) + " has rank " +
                                  std::to_string(t.shape.size()) + ", not 2; " + kBatchLayout);
  return t;
}

}  // namespace

void check_weights_header(const WeightsHeader& header, const std::vector<ParamSpec>& specs,
                          const std::string& source) {
  check_weight_names(header, specs, source);
  for (const auto& spec : specs) check_declared_weight(header.at(spec.name), spec, source);
}

WeightsHeader header_of(const std::vector<st::StEntry>& entries) {
  WeightsHeader h;
  for (const auto& e : entries) h[e.name] = {e.dtype, e.shape};
  return h;
}

std::map<std::string, std::vector<double>> weights_from_st(const StFile& file,
                                                           const std::vector<ParamSpec>& specs,
                                                           const std::string& source) {
  WeightsHeader header;
  for (const auto& [name, t] : file.tensors) header[name] = {t.dtype, t.shape};
  check_weights_header(header, specs, source);
  std::map<std::string, std::vector<double>> out;
  for (const auto& spec : specs)
    out[spec.name] = checked_weight(file.tensors.at(spec.name), spec, source);
  return out;
}

std::map<std::string, std::vector<double>> load_weights(const std::string& path,
                                                        const std::vector<ParamSpec>& specs) {
  // The header against the config before a tensor is read: a file that declares another
  // shape (sparse, of any size) costs its header, not its declared bytes (issue 51, 4).
  st::StReader file(path);
  check_weights_header(header_of(file.entries()), specs, path);
  StFile w;
  for (const auto& e : file.entries()) w.tensors[e.name] = file.read(e);
  return weights_from_st(w, specs, path);
}

StFile weights_to_st(const std::vector<ParamSpec>& specs,
                     const std::map<std::string, std::vector<double>>& values, DType as) {
  if (as != DType::F32 && as != DType::F64)
    throw Error(std::string("save_weights: dtype ") + st::st_dtype_name(as) +
                " is not F32 or F64");
  StFile file;
  for (const auto& spec : specs)
    file.tensors[spec.name] = st::st_from_f64(spec.shape, checked_values(values, spec, as), as);
  if (values.size() != file.tensors.size())
    for (const auto& [name, v] : values)
      if (!file.tensors.count(name))
        throw Error("save_weights: values for '" + name + "', which is not a parameter");
  file.metadata["format"] = "pt";
  return file;
}

void save_weights(const std::string& path, const std::vector<ParamSpec>& specs,
                  const std::map<std::string, std::vector<double>>& values, DType as) {
  st::write_safetensors(path, weights_to_st(specs, values, as));
}

GptBatch gpt_batch_from_st(const StFile& file, const std::string& source) {
  for (const auto& [name, t] : file.tensors)
    if (name != "input_ids" && name != "labels")
      fail_tensor(source, name, std::string("unexpected; ") + kBatchLayout);
  const StTensor& ids = batch_tensor(file, "input_ids", source);
  const StTensor& labels = batch_tensor(file, "labels", source);

  const std::int64_t B = ids.shape[0], T = ids.shape[1];
  if (B < 1 || T < 2)
    fail_tensor(source, "input_ids", "shape " + shape_str(ids.shape) +
                                         " needs B >= 1 rows and T >= 2 positions, so that "
                                         "there is a label to predict");
  if (labels.shape != Shape{B, T - 1})
    fail_tensor(source, "labels", "shape " + shape_str(labels.shape) + " but input_ids " +
                                      shape_str(ids.shape) + " needs " + shape_str({B, T - 1}));
  GptBatch b;
  b.B = B;
  b.T = T;
  b.input_ids = ids.to_i64();
  b.labels = labels.to_i64();
  return b;
}

GptBatch load_gpt_batch(const std::string& path) {
  return gpt_batch_from_st(st::read_safetensors(path), path);
}

StFile gpt_batch_to_st(const GptBatch& b) {
  if (b.B < 1 || b.T < 2)
    throw Error("save_gpt_batch: B=" + std::to_string(b.B) + " T=" + std::to_string(b.T) +
                "; a batch needs B >= 1 and T >= 2");
  // st_from_i64 checks that input_ids and labels fill [B,T] and [B,T-1].
  StFile file;
  file.tensors["input_ids"] = st::st_from_i64({b.B, b.T}, b.input_ids);
  file.tensors["labels"] = st::st_from_i64({b.B, b.T - 1}, b.labels);
  file.metadata["format"] = "pt";
  return file;
}

void save_gpt_batch(const std::string& path, const GptBatch& batch) {
  st::write_safetensors(path, gpt_batch_to_st(batch));
}

}  // namespace tpsim
