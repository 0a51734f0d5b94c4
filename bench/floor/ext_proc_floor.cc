// The design's floor: an ext_proc server that does the least our server's shape allows, compiled.
// One bidi stream per request (as Envoy opens them): headers -> continue; body -> the same body back as a
// body mutation with its content-length set (the reply shape of extproc/envoy_messages.replace_body);
// anything else -> an empty reply of the same kind. gRPC health answers SERVING for Envoy's checks.
//
// Usage: ext_proc_floor unix:/path/to.sock   (prints "ready" once listening)
// Built by bench/floor/build.py with Debian's grpc++ from messages generated out of the xds-protos wheel.
#include <grpcpp/grpcpp.h>
#include <grpcpp/health_check_service_interface.h>

#include <cstdio>
#include <memory>
#include <string>

#include "envoy/service/ext_proc/v3/external_processor.grpc.pb.h"

namespace {

using envoy::service::ext_proc::v3::ExternalProcessor;
using envoy::service::ext_proc::v3::ProcessingRequest;
using envoy::service::ext_proc::v3::ProcessingResponse;

constexpr char kService[] = "envoy.service.ext_proc.v3.ExternalProcessor";

// Fills `reply` for `request`; the reply object is reused across the messages of a stream.
void Answer(const ProcessingRequest& request, ProcessingResponse* reply) {
  reply->Clear();
  switch (request.request_case()) {
    case ProcessingRequest::kRequestHeaders:
      reply->mutable_request_headers();
      break;
    case ProcessingRequest::kRequestBody: {
      const std::string& body = request.request_body().body();
      auto* common = reply->mutable_request_body()->mutable_response();
      auto* option = common->mutable_header_mutation()->add_set_headers();
      option->set_append_action(envoy::config::core::v3::HeaderValueOption::OVERWRITE_IF_EXISTS_OR_ADD);
      option->mutable_header()->set_key("content-length");
      option->mutable_header()->set_raw_value(std::to_string(body.size()));
      common->mutable_body_mutation()->set_body(body);
      break;
    }
    case ProcessingRequest::kResponseHeaders:
      reply->mutable_response_headers();
      break;
    case ProcessingRequest::kResponseBody:
      reply->mutable_response_body();
      break;
    default:
      break;
  }
}

class Stream final : public grpc::ServerBidiReactor<ProcessingRequest, ProcessingResponse> {
 public:
  Stream() { StartRead(&request_); }

  void OnReadDone(bool ok) override {
    if (!ok) {  // Envoy half-closed or reset the stream
      Finish(grpc::Status::OK);
      return;
    }
    Answer(request_, &reply_);
    StartWrite(&reply_);
  }

  void OnWriteDone(bool ok) override {
    if (!ok) {
      Finish(grpc::Status::OK);
      return;
    }
    StartRead(&request_);
  }

  void OnDone() override { delete this; }

 private:
  ProcessingRequest request_;
  ProcessingResponse reply_;
};

class Processor final : public ExternalProcessor::CallbackService {
  grpc::ServerBidiReactor<ProcessingRequest, ProcessingResponse>* Process(grpc::CallbackServerContext*) override {
    return new Stream();
  }
};

}  // namespace

int main(int argc, char** argv) {
  if (argc != 2) {
    std::fprintf(stderr, "usage: %s unix:/path/to.sock\n", argv[0]);
    return 2;
  }
  grpc::EnableDefaultHealthCheckService(true);
  Processor processor;
  grpc::ServerBuilder builder;
  builder.AddListeningPort(argv[1], grpc::InsecureServerCredentials());
  builder.AddChannelArgument(GRPC_ARG_MAX_CONCURRENT_STREAMS, 0x7FFFFFFF);
  builder.SetMaxReceiveMessageSize(64 << 20);  // our server's limit is 32 MiB by default; never the bound here
  builder.SetMaxSendMessageSize(64 << 20);
  builder.RegisterService(&processor);
  std::unique_ptr<grpc::Server> server = builder.BuildAndStart();
  if (!server) {
    std::fprintf(stderr, "cannot listen on %s\n", argv[1]);
    return 1;
  }
  server->GetHealthCheckService()->SetServingStatus(kService, true);
  std::printf("ready\n");
  std::fflush(stdout);
  server->Wait();
  return 0;
}
