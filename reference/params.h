// The reference model's parameters: one full (unsharded) row-major Eigen matrix per
// parameter name, initialised from the same seeded, index-addressable init as the sharded
// model (src/init), so both sides start from identical numbers without sharing model code.
//
// Independence: the reference uses only model/config.h, init/, core/errors.h,
// core/host_memory.h (where memory pages come from, not what is computed) and Eigen.
// Nothing here may include src/backend, src/comm or sharded/.
#pragma once

#include <Eigen/Dense>
#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "core/errors.h"
#include "core/host_memory.h"
#include "init/init.h"
#include "model/config.h"

namespace tpsim::ref {

template <class S>
using Matrix = Eigen::Matrix<S, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>;
template <class S>
using Vector = Eigen::Matrix<S, Eigen::Dynamic, 1>;

// Full shapes. A 1-D parameter of length C is stored as [1,C] so every entry is a Matrix.
template <class S>
using ParamSet = std::map<std::string, Matrix<S>>;

// Matrix::resize, whose new storage (wte-sized for the model state and the logits) is
// advised onto huge pages before anything touches it: see core/host_memory.h.
template <class S>
void resize_on_huge_pages(Matrix<S>& m, Eigen::Index rows, Eigen::Index cols) {
  const S* before = m.data();
  m.resize(rows, cols);
  if (m.data() != before) advise_huge_pages(m.data(), static_cast<std::size_t>(m.size()) * sizeof(S));
}

// A [rows, cols] matrix of zeros on huge pages where large.
template <class S>
Matrix<S> zeros_on_huge_pages(Eigen::Index rows, Eigen::Index cols) {
  Matrix<S> m;
  resize_on_huge_pages(m, rows, cols);
  m.setZero();
  return m;
}

// The [rows, cols] a ParamSpec's full shape is stored as; throws UsageError on 0-D or >2-D.
inline std::pair<Eigen::Index, Eigen::Index> stored_shape(const ParamSpec& spec) {
  if (spec.shape.size() == 1) return {1, static_cast<Eigen::Index>(spec.shape[0])};
  if (spec.shape.size() == 2)
    return {static_cast<Eigen::Index>(spec.shape[0]), static_cast<Eigen::Index>(spec.shape[1])};
  throw UsageError("reference: parameter " + spec.name + " has " +
                   std::to_string(spec.shape.size()) + " dims; only 1-D and 2-D are supported");
}

// Every parameter at full size: entry (r,c) is the value at row-major flat index r*cols+c,
// generated whole by init_block (the same values, pair by pair, that shards get).
template <class S>
ParamSet<S> init_params(const std::vector<ParamSpec>& specs, std::uint64_t seed) {
  ParamSet<S> out;
  for (const ParamSpec& spec : specs) {
    const auto [rows, cols] = stored_shape(spec);
    Matrix<S> m;  // [rows, cols], full, row-major like the flat index
    resize_on_huge_pages(m, rows, cols);
    init_block<S>(m.data(), seed, spec.name, spec.init, spec.shape, -1, 0, 0);
    if (!out.emplace(spec.name, std::move(m)).second)
      throw UsageError("reference: parameter name " + spec.name + " appears twice in the specs");
  }
  return out;
}

// Zeros with the stored shape of every spec: the layout of gradients and optimizer state.
template <class S>
ParamSet<S> zeros_like_specs(const std::vector<ParamSpec>& specs) {
  ParamSet<S> out;
  for (const ParamSpec& spec : specs) {
    const auto [rows, cols] = stored_shape(spec);
    out[spec.name] = zeros_on_huge_pages<S>(rows, cols);
  }
  return out;
}

// Throws UsageError unless `params` holds exactly the specs' names, each at its stored
// shape. `where` prefixes the message ("reference Gpt").
template <class S>
void check_params(const std::vector<ParamSpec>& specs, const ParamSet<S>& params,
                  const std::string& where) {
  for (const ParamSpec& spec : specs) {
    const auto it = params.find(spec.name);
    if (it == params.end()) throw UsageError(where + ": parameter " + spec.name + " is missing");
    const auto [rows, cols] = stored_shape(spec);
    if (it->second.rows() != rows || it->second.cols() != cols)
      throw UsageError(where + ": parameter " + spec.name + " is [" +
                       std::to_string(it->second.rows()) + "," + std::to_string(it->second.cols()) +
                       "], expected [" + std::to_string(rows) + "," + std::to_string(cols) + "]");
  }
  if (params.size() != specs.size()) {
    for (const auto& [name, m] : params) {
      bool known = false;
      for (const ParamSpec& spec : specs) known = known || spec.name == name;
      if (!known) throw UsageError(where + ": unexpected parameter " + name);
    }
  }
}

}  // namespace tpsim::ref
