// The two-layer MLP of mlp_demo and tessel-bench's mlp_grad_step:
// pred = tanh(x @ w1 + b1) @ w2 + b2, trained by SGD on mean squared error.
// One training step is one graph (w1, b1, w2, b2, x, y) -> (loss, w1', b1',
// w2', b2'), its gradients taken by the compiler (GraphBuilder::ValueAndGrad)
// or, as a baseline, written out by hand.
#pragma once

#include <utility>
#include <vector>

#include "tessel/graph.h"

namespace tessel::mlp {

struct Shape {
  int64_t batch = 512, in = 16, hidden = 64, out = 1;
  float learning_rate = 0.1f;
};

inline ArrayType F32(std::vector<int64_t> dims) { return ArrayType{DType::kF32, std::move(dims)}; }

struct Params {
  Value w1, b1, w2, b2;
};

inline Params Parameters(GraphBuilder& g, const Shape& s) {
  return Params{g.Parameter(F32({s.in, s.hidden}), "w1"), g.Parameter(F32({s.hidden}), "b1"),
                g.Parameter(F32({s.hidden, s.out}), "w2"), g.Parameter(F32({s.out}), "b2")};
}

// {pred, h}.
inline std::pair<Value, Value> Forward(GraphBuilder& g, const Params& m, Value x, const Shape& s) {
  Value h = g.Tanh(g.Add(g.MatMul(x, m.w1), g.BroadcastInDim(m.b1, {s.batch, s.hidden}, {1})));
  Value pred = g.Add(g.MatMul(h, m.w2), g.BroadcastInDim(m.b2, {s.batch, s.out}, {1}));
  return {pred, h};
}

inline Value Loss(GraphBuilder& g, Value pred, Value y, const Shape& s) {
  Value err = g.Sub(pred, y);
  return g.Div(g.Reduce(g.Mul(err, err), ReduceKind::kSum, {0, 1}),
               g.Scalar(DType::kF32, double(s.batch)));
}

inline Value Sgd(GraphBuilder& g, Value w, Value dw, const Shape& s) {
  return g.Sub(w, g.Mul(dw, g.Broadcast(g.Scalar(DType::kF32, s.learning_rate), dw.type().dims)));
}

// The step with its gradients from ValueAndGrad.
inline absl::StatusOr<Graph> TrainStep(const Shape& s) {
  GraphBuilder g("mlp_train_step");
  Params m = Parameters(g, s);
  Value x = g.Parameter(F32({s.batch, s.in}), "x");
  Value y = g.Parameter(F32({s.batch, s.out}), "y");
  auto loss = [&s](GraphBuilder& f, const std::vector<Value>& p) {
    const Params fm{p[0], p[1], p[2], p[3]};
    return std::vector<Value>{Loss(f, Forward(f, fm, p[4], s).first, p[5], s)};
  };
  std::vector<Value> r = g.ValueAndGrad(loss, {m.w1, m.b1, m.w2, m.b2, x, y}, {0, 1, 2, 3});
  if (!g.status().ok()) return g.status();
  return g.Build({r[0], Sgd(g, m.w1, r[1], s), Sgd(g, m.b1, r[2], s), Sgd(g, m.w2, r[3], s),
                  Sgd(g, m.b2, r[4], s)});
}

// The same step with its backward pass written out by hand.
inline absl::StatusOr<Graph> HandWrittenTrainStep(const Shape& s) {
  GraphBuilder g("mlp_train_step_by_hand");
  Params m = Parameters(g, s);
  Value x = g.Parameter(F32({s.batch, s.in}), "x");
  Value y = g.Parameter(F32({s.batch, s.out}), "y");
  auto [pred, h] = Forward(g, m, x, s);
  Value loss = Loss(g, pred, y, s);
  Value err = g.Sub(pred, y);
  Value dpred =
      g.Mul(err, g.Broadcast(g.Scalar(DType::kF32, 2.0 / double(s.batch)), {s.batch, s.out}));
  Value dw2 = g.DotGeneral(h, dpred, {{}, {}, {0}, {0}});
  Value db2 = g.Reduce(dpred, ReduceKind::kSum, {0});
  Value dh = g.DotGeneral(dpred, m.w2, {{}, {}, {1}, {1}});
  Value one = g.Broadcast(g.Scalar(DType::kF32, 1.0), {s.batch, s.hidden});
  Value dh_pre = g.Mul(dh, g.Sub(one, g.Mul(h, h)));
  Value dw1 = g.DotGeneral(x, dh_pre, {{}, {}, {0}, {0}});
  Value db1 = g.Reduce(dh_pre, ReduceKind::kSum, {0});
  return g.Build({loss, Sgd(g, m.w1, dw1, s), Sgd(g, m.b1, db1, s), Sgd(g, m.w2, dw2, s),
                  Sgd(g, m.b2, db2, s)});
}

inline absl::StatusOr<Graph> EvalLoss(const Shape& s) {
  GraphBuilder g("mlp_eval");
  Params m = Parameters(g, s);
  Value x = g.Parameter(F32({s.batch, s.in}), "x");
  Value y = g.Parameter(F32({s.batch, s.out}), "y");
  return g.Build({Loss(g, Forward(g, m, x, s).first, y, s)});
}

}  // namespace tessel::mlp
