// Row surgery on stored tensors, for readers of other frameworks' layouts: a Conv1D weight
// stored [in, out] turned to tpsim's [out, in], and a fused tensor's parts gathered from
// their rows (model/foreign_names.h says which rows).
#pragma once

#include <vector>

#include "io/safetensors.h"
#include "model/foreign_names.h"

namespace tpsim::st {

// A 2-D tensor [R, C] as [C, R].
StTensor transposed(const StTensor& t);

// The rows `runs` of t [rows, ...] (a 1-D tensor's elements), one run after another.
// Expects runs inside t's rows (fused_part_rows of a shape the caller checked).
StTensor gather_rows(const StTensor& t, const std::vector<RowRun>& runs);

}  // namespace tpsim::st
