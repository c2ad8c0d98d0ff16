// grpc.reflection.v1.ServerReflection, served from the linked-in protobuf
// descriptors (the generated pool), beside gRPC's own v1alpha plugin: tools
// that speak only v1 (newer grpcurl, Postman) can list and describe every
// service, grpc.health.v1.Health included.
#pragma once

#include <string>
#include <vector>

#include "grpc/reflection/v1/reflection.grpc.pb.h"

namespace tessel {

class ReflectionV1Service final : public grpc::reflection::v1::ServerReflection::Service {
 public:
  // `services`: the fully qualified names the server serves; the health and
  // both reflection services are added.
  explicit ReflectionV1Service(std::vector<std::string> services);

  grpc::Status ServerReflectionInfo(
      grpc::ServerContext* ctx,
      grpc::ServerReaderWriter<grpc::reflection::v1::ServerReflectionResponse,
                               grpc::reflection::v1::ServerReflectionRequest>* stream) override;

 private:
  std::vector<std::string> services_;
};

}  // namespace tessel
