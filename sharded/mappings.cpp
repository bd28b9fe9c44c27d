#include "sharded/mappings.h"

namespace tpsim {

namespace {
void check_cols(const char* op, const Tensor& wide, const Tensor& narrow, int world) {
  if (wide.ndim() != 2 || narrow.ndim() != 2 || wide.dim(0) != narrow.dim(0) ||
      wide.dim(1) != narrow.dim(1) * world)
    throw Error(std::string(op) + ": expected [M,N] and [M,N/" + std::to_string(world) +
                "], got " + wide.tag() + " " + shape_str(wide.shape()) + " and " + narrow.tag() +
                " " + shape_str(narrow.shape()));
}
}  // namespace

void copy_to_tp_region_backward(Communicator& comm, Tensor& dx) {
  comm.all_reduce(dx, ReduceOp::Sum);
}

void reduce_from_tp_region_forward(Communicator& comm, Tensor& y) {
  comm.all_reduce(y, ReduceOp::Sum);
}

void scatter_to_tp_region_forward(Backend& be, Communicator& comm, Tensor& out, const Tensor& in) {
  check_cols("scatter_to_tp_region", in, out, comm.world_size());
  be.copy_columns(out, in, out.dim(1) * comm.rank());
}

void gather_from_tp_region_forward(Backend& be, Communicator& comm, Tensor& out,
                                   const Tensor& in) {
  const int t = comm.world_size();
  check_cols("gather_from_tp_region", out, in, t);
  // The collective concatenates along dim 0: gather [t,M,N/t], then interleave columns.
  Tensor chunks = be.empty({t, in.dim(0), in.dim(1)}, in.dtype(), MemCategory::CommBuffer,
                           "gather_from_tp_region.chunks");
  comm.all_gather(in, chunks);
  for (int r = 0; r < t; ++r) {
    Tensor part = chunks.narrow0(r, 1).reshape(in.shape());
    be.set_columns(out, part, in.dim(1) * r);
  }
}

void scatter_to_tp_region_backward(Backend& be, Communicator& comm, Tensor& din,
                                   const Tensor& dout) {
  gather_from_tp_region_forward(be, comm, din, dout);
}

void gather_from_tp_region_backward(Backend& be, Communicator& comm, Tensor& din,
                                    const Tensor& dout) {
  scatter_to_tp_region_forward(be, comm, din, dout);
}

void gather_from_sp_region_forward(Communicator& comm, Tensor& out, const Tensor& in) {
  comm.all_gather(in, out);
}

void gather_from_sp_region_backward(Communicator& comm, Tensor& din, const Tensor& dout) {
  comm.reduce_scatter(dout, din, ReduceOp::Sum);
}

void reduce_scatter_to_sp_region_forward(Communicator& comm, Tensor& out, const Tensor& in) {
  comm.reduce_scatter(in, out, ReduceOp::Sum);
}

void reduce_scatter_to_sp_region_backward(Communicator& comm, Tensor& din, const Tensor& dout) {
  comm.all_gather(dout, din);
}

}  // namespace tpsim
