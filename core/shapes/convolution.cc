// convolution (StableHLO's).
#include <algorithm>

#include "core/shapes/shape_rules.h"

namespace tessel {

v1::ConvolutionAttrs ConvolutionWithDefaults(const v1::ConvolutionAttrs& a) {
  v1::ConvolutionAttrs c = a;
  const int s = a.input_spatial_dimensions_size();
  auto fill = [s](google::protobuf::RepeatedField<int64_t>* f, int64_t v) {
    if (f->empty()) f->Resize(s, v);
  };
  fill(c.mutable_window_strides(), 1);
  fill(c.mutable_padding_low(), 0);
  fill(c.mutable_padding_high(), 0);
  fill(c.mutable_lhs_dilation(), 1);
  fill(c.mutable_rhs_dilation(), 1);
  if (c.feature_group_count() == 0) c.set_feature_group_count(1);
  if (c.batch_group_count() == 0) c.set_batch_group_count(1);
  return c;
}

ConvolutionSpecs ConvolutionSpecsOf(const v1::ConvolutionAttrs& a) {
  ConvolutionSpecs s;
  s.lhs = {a.input_batch_dimension(), a.input_feature_dimension()};
  s.rhs = {a.kernel_output_feature_dimension(), a.kernel_input_feature_dimension()};
  s.out = {a.output_batch_dimension(), a.output_feature_dimension()};
  for (int i = 0; i < a.input_spatial_dimensions_size(); ++i) {
    s.lhs.push_back(a.input_spatial_dimensions(i));
    s.rhs.push_back(a.kernel_spatial_dimensions(i));
    s.out.push_back(a.output_spatial_dimensions(i));
  }
  return s;
}

int64_t DilatedExtent(int64_t n, int64_t dilation) { return n == 0 ? 0 : (n - 1) * dilation + 1; }

int64_t ConvolutionOutputExtent(const v1::ConvolutionAttrs& a, int i, int64_t in, int64_t window) {
  const int64_t padded =
      DilatedExtent(in, a.lhs_dilation(i)) + a.padding_low(i) + a.padding_high(i);
  const int64_t w = DilatedExtent(window, a.rhs_dilation(i));
  if (padded < 0 || padded < w) return 0;
  return (padded - w) / a.window_strides(i) + 1;
}

namespace shapes {
namespace {

absl::StatusOr<TensorType> Convolution(const v1::Node& n, Operands ops) {
  TESSEL_RETURN_IF_ERROR(CheckArity(ops.size(), 2));
  TESSEL_RETURN_IF_ERROR(CheckAttrs(n, v1::Node::kConvolution, "convolution"));
  const TensorType &l = *ops[0], &r = *ops[1];
  if (l.dtype() != r.dtype()) {
    return InvalidArgumentError(
        StrCat("operands must share a dtype: got ", TypeString(l), " and ", TypeString(r)));
  }
  TESSEL_RETURN_IF_ERROR(CheckDType("convolution operand", Admits::kNumeric, l));
  const v1::ConvolutionAttrs a = ConvolutionWithDefaults(n.convolution());
  const int s = a.input_spatial_dimensions_size();
  const int rank = s + 2;
  if (l.dims_size() != rank || r.dims_size() != rank) {
    return InvalidArgumentError(StrCat("with ", s,
                                       " spatial dimensions both operands must have rank ", rank,
                                       ": got lhs ", TypeString(l), " and rhs ", TypeString(r)));
  }
  auto check_list = [&](absl::string_view what, int size) -> absl::Status {
    if (size != s) {
      return InvalidArgumentError(
          StrCat(what, " must have one entry per spatial dimension (", s, "): got ", size));
    }
    return absl::OkStatus();
  };
  TESSEL_RETURN_IF_ERROR(
      check_list("kernel_spatial_dimensions", a.kernel_spatial_dimensions_size()));
  TESSEL_RETURN_IF_ERROR(
      check_list("output_spatial_dimensions", a.output_spatial_dimensions_size()));
  TESSEL_RETURN_IF_ERROR(check_list("window_strides", a.window_strides_size()));
  TESSEL_RETURN_IF_ERROR(check_list("padding_low", a.padding_low_size()));
  TESSEL_RETURN_IF_ERROR(check_list("padding_high", a.padding_high_size()));
  TESSEL_RETURN_IF_ERROR(check_list("lhs_dilation", a.lhs_dilation_size()));
  TESSEL_RETURN_IF_ERROR(check_list("rhs_dilation", a.rhs_dilation_size()));
  auto dims_of = [](int64_t x, int64_t y, const auto& rest) {
    std::vector<int64_t> d = {x, y};
    d.insert(d.end(), rest.begin(), rest.end());
    return d;
  };
  TESSEL_RETURN_IF_ERROR(CheckUniqueDims(
      "input dimension",
      dims_of(a.input_batch_dimension(), a.input_feature_dimension(), a.input_spatial_dimensions()),
      rank));
  TESSEL_RETURN_IF_ERROR(
      CheckUniqueDims("kernel dimension",
                      dims_of(a.kernel_input_feature_dimension(),
                              a.kernel_output_feature_dimension(), a.kernel_spatial_dimensions()),
                      rank));
  TESSEL_RETURN_IF_ERROR(
      CheckUniqueDims("output dimension",
                      dims_of(a.output_batch_dimension(), a.output_feature_dimension(),
                              a.output_spatial_dimensions()),
                      rank));
  for (int i = 0; i < s; ++i) {
    if (a.window_strides(i) < 1 || a.lhs_dilation(i) < 1 || a.rhs_dilation(i) < 1) {
      return InvalidArgumentError(StrCat("window strides and dilations must be >= 1: got stride ",
                                         a.window_strides(i), ", lhs_dilation ", a.lhs_dilation(i),
                                         ", rhs_dilation ", a.rhs_dilation(i),
                                         " for spatial dimension ", i));
    }
  }
  const int64_t g = a.feature_group_count(), b = a.batch_group_count();
  if (g < 1 || b < 1 || (g > 1 && b > 1)) {
    return InvalidArgumentError(
        StrCat("feature_group_count and batch_group_count must be >= 1 and "
               "not both > 1: got ",
               g, " and ", b));
  }
  const int64_t batch = l.dims(a.input_batch_dimension());
  const int64_t features = l.dims(a.input_feature_dimension());
  const int64_t in_features = r.dims(a.kernel_input_feature_dimension());
  const int64_t out_features = r.dims(a.kernel_output_feature_dimension());
  if (features % g != 0 || features / g != in_features) {
    return InvalidArgumentError(StrCat("lhs's feature dimension (", features,
                                       ") must be feature_group_count (", g,
                                       ") times rhs's input feature dimension (", in_features,
                                       "): lhs ", TypeString(l), ", rhs ", TypeString(r)));
  }
  if (out_features % g != 0 || out_features % b != 0 || batch % b != 0) {
    return InvalidArgumentError(StrCat(
        "rhs's output feature dimension (", out_features, ") must divide by feature_group_count (",
        g, ") and batch_group_count (", b, "), and lhs's batch dimension (", batch,
        ") by batch_group_count: lhs ", TypeString(l), ", rhs ", TypeString(r)));
  }
  std::vector<int64_t> out(rank);
  out[a.output_batch_dimension()] = batch / b;
  out[a.output_feature_dimension()] = out_features;
  for (int i = 0; i < s; ++i) {
    out[a.output_spatial_dimensions(i)] = ConvolutionOutputExtent(
        a, i, l.dims(a.input_spatial_dimensions(i)), r.dims(a.kernel_spatial_dimensions(i)));
  }
  TensorType t = Make(l.dtype(), out);
  TESSEL_RETURN_IF_ERROR(ValidateType(t));
  return t;
}

}  // namespace

void ConvolutionShapes(ShapeRows& rows) { rows.emplace_back(v1::CONVOLUTION, Convolution); }

}  // namespace shapes
}  // namespace tessel
