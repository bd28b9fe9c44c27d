// The reference for the seed's 0_naive_tensor_parallel.py: y = fc2(relu(fc1(x))), no
// bias, Linear weights [out,in] (y = x W^T), loss = mean((y - target)^2) over every
// element, plain SGD. Full matrices, explicit backward.
#pragma once

#include "model/config.h"
#include "reference/params.h"

namespace tpsim::ref {

template <class S>
class Mlp {
 public:
  Mlp(const MlpConfig& config, ParamSet<S> params);

  // Forward and backward on one batch; returns the loss and fills output() [rows,out] and
  // grads() (overwritten, not accumulated).
  S forward_backward(const MlpBatch& batch);
  void sgd_step(double lr);  // p -= lr * grad, every parameter

  const Matrix<S>& output() const { return y_; }
  // dloss/dx [rows, in]. Not a parameter gradient, but the one that shows whether a
  // column-parallel fc1 all-reduces its input gradient (the f operator's backward).
  const Matrix<S>& input_grad() const { return dx_; }
  const ParamSet<S>& params() const { return params_; }
  const ParamSet<S>& grads() const { return grads_; }
  // What the verifier's error model of relu's kink reads (verify/engine/tolerance.cpp).
  const Matrix<S>& input() const { return x_; }
  const Matrix<S>& pre_activation() const { return h_pre_; }
  const Matrix<S>& relu_output_grad() const { return dh_out_; }
  void set_params(ParamSet<S> params);  // checked against mlp_param_specs

 private:
  MlpConfig config_;
  ParamSet<S> params_;
  ParamSet<S> grads_;
  Matrix<S> x_;       // [rows, in]       the batch input, in S
  Matrix<S> h_pre_;   // [rows, hidden]   fc1 output, saved for relu backward
  Matrix<S> h_;       // [rows, hidden]   relu output, saved for fc2's weight gradient
  Matrix<S> y_;       // [rows, out]      the model output
  Matrix<S> dh_out_;  // [rows, hidden]   gradient at relu's output, before its mask
  Matrix<S> dx_;      // [rows, in]       gradient of the loss with respect to x
};

extern template class Mlp<float>;
extern template class Mlp<double>;

}  // namespace tpsim::ref
