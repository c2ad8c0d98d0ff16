#include "core/reflection_v1.h"

#include <google/protobuf/descriptor.h>
#include <google/protobuf/descriptor.pb.h>

#include <set>

#include "absl/strings/str_cat.h"
#include "grpc/health/v1/health.pb.h"

namespace tessel {
namespace {

namespace rv1 = grpc::reflection::v1;
using google::protobuf::DescriptorPool;
using google::protobuf::FileDescriptor;

// `file` and everything it imports, each once, imports first.
void AddFile(const FileDescriptor* file, std::set<std::string>* seen,
             rv1::FileDescriptorResponse* out) {
  if (!seen->insert(file->name()).second) return;
  for (int i = 0; i < file->dependency_count(); ++i) AddFile(file->dependency(i), seen, out);
  google::protobuf::FileDescriptorProto proto;
  file->CopyTo(&proto);
  proto.SerializeToString(out->add_file_descriptor_proto());
}

void Error(rv1::ServerReflectionResponse* resp, grpc::StatusCode code, std::string message) {
  resp->mutable_error_response()->set_error_code(code);
  resp->mutable_error_response()->set_error_message(std::move(message));
}

}  // namespace

ReflectionV1Service::ReflectionV1Service(std::vector<std::string> services)
    : services_(std::move(services)) {
  // Linking the health messages registers their file in the generated pool.
  (void)grpc::health::v1::HealthCheckRequest::descriptor();
  for (const char* s : {"grpc.health.v1.Health", "grpc.reflection.v1.ServerReflection",
                        "grpc.reflection.v1alpha.ServerReflection"}) {
    services_.push_back(s);
  }
}

grpc::Status ReflectionV1Service::ServerReflectionInfo(
    grpc::ServerContext*,
    grpc::ServerReaderWriter<rv1::ServerReflectionResponse, rv1::ServerReflectionRequest>* stream) {
  const DescriptorPool* pool = DescriptorPool::generated_pool();
  rv1::ServerReflectionRequest req;
  while (stream->Read(&req)) {
    rv1::ServerReflectionResponse resp;
    resp.set_valid_host(req.host());
    *resp.mutable_original_request() = req;
    std::set<std::string> seen;
    switch (req.message_request_case()) {
      case rv1::ServerReflectionRequest::kListServices:
        for (const std::string& s : services_)
          resp.mutable_list_services_response()->add_service()->set_name(s);
        break;
      case rv1::ServerReflectionRequest::kFileByFilename:
        if (const FileDescriptor* f = pool->FindFileByName(req.file_by_filename())) {
          AddFile(f, &seen, resp.mutable_file_descriptor_response());
        } else {
          Error(&resp, grpc::StatusCode::NOT_FOUND,
                absl::StrCat("no file '", req.file_by_filename(), "'"));
        }
        break;
      case rv1::ServerReflectionRequest::kFileContainingSymbol:
        if (const FileDescriptor* f =
                pool->FindFileContainingSymbol(req.file_containing_symbol())) {
          AddFile(f, &seen, resp.mutable_file_descriptor_response());
        } else {
          Error(&resp, grpc::StatusCode::NOT_FOUND,
                absl::StrCat("no symbol '", req.file_containing_symbol(), "'"));
        }
        break;
      case rv1::ServerReflectionRequest::kFileContainingExtension: {
        const auto* type =
            pool->FindMessageTypeByName(req.file_containing_extension().containing_type());
        const auto* ext = type ? pool->FindExtensionByNumber(
                                     type, req.file_containing_extension().extension_number())
                               : nullptr;
        if (ext != nullptr) {
          AddFile(ext->file(), &seen, resp.mutable_file_descriptor_response());
        } else {
          Error(&resp, grpc::StatusCode::NOT_FOUND,
                absl::StrCat("no extension ", req.file_containing_extension().extension_number(),
                             " of '", req.file_containing_extension().containing_type(), "'"));
        }
        break;
      }
      case rv1::ServerReflectionRequest::kAllExtensionNumbersOfType:
        if (const auto* type = pool->FindMessageTypeByName(req.all_extension_numbers_of_type())) {
          std::vector<const google::protobuf::FieldDescriptor*> exts;
          pool->FindAllExtensions(type, &exts);
          auto* out = resp.mutable_all_extension_numbers_response();
          out->set_base_type_name(type->full_name());
          for (const auto* e : exts) out->add_extension_number(e->number());
        } else {
          Error(&resp, grpc::StatusCode::NOT_FOUND,
                absl::StrCat("no message type '", req.all_extension_numbers_of_type(), "'"));
        }
        break;
      default:
        Error(&resp, grpc::StatusCode::INVALID_ARGUMENT, "expected one of the reflection requests");
    }
    if (!stream->Write(resp)) break;
  }
  return grpc::Status::OK;
}

}  // namespace tessel
