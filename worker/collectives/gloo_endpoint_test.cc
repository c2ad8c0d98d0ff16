// Gloo plumbing: exceptions as statuses, the store's "is it set" probe, and
// a joining group's store giving up at once when a peer abandons the group.
#include "worker/collectives/gloo_endpoint.h"

#include <gloo/rendezvous/hash_store.h>
#include <gtest/gtest.h>

#include <stdexcept>
#include <thread>

#include "absl/time/clock.h"

namespace tessel::worker {
namespace {

TEST(GlooPlumbing, ExceptionsBecomeStatusesByWhatTheySay) {
  EXPECT_EQ(CatchGloo("ctx", [] { throw gloo::IoException("Timed out waiting"); }).code(),
            absl::StatusCode::kDeadlineExceeded);
  const absl::Status io = CatchGloo("ctx", [] { throw gloo::IoException("connection reset"); });
  EXPECT_EQ(io.code(), absl::StatusCode::kUnavailable);
  EXPECT_EQ(io.message(), "ctx: connection reset");
  EXPECT_EQ(CatchGloo("ctx", [] { throw std::runtime_error("bad state"); }).code(),
            absl::StatusCode::kInternal);
  EXPECT_EQ(CatchGloo("ctx", [] { throw std::runtime_error("DEADLINE_EXCEEDED: key"); }).code(),
            absl::StatusCode::kDeadlineExceeded);
  EXPECT_TRUE(CatchGloo("ctx", [] {}).ok());
}

TEST(GlooPlumbing, KeyIsSetLooksWithoutWaiting) {
  gloo::rendezvous::HashStore store;
  EXPECT_FALSE(KeyIsSet(store, "k"));
  store.set("k", {'1'});
  EXPECT_TRUE(KeyIsSet(store, "k"));
}

TEST(GlooPlumbing, AJoiningWaitGivesUpAtOnceWhenAPeerAbandonsTheGroup) {
  gloo::rendezvous::HashStore inner;
  WatchfulStore store(inner, "g/abandoned", std::chrono::seconds(30));
  std::thread peer([&] {
    absl::SleepFor(absl::Milliseconds(200));
    inner.set("g/abandoned", {'1'});
  });
  const absl::Time start = absl::Now();
  const absl::Status s = CatchGloo("join", [&] { store.wait({"g/never"}); });
  peer.join();
  EXPECT_EQ(s.code(), absl::StatusCode::kUnavailable) << s;
  EXPECT_NE(s.message().find("a peer gave up on this group"), std::string::npos) << s;
  EXPECT_LT(absl::Now() - start, absl::Seconds(5));
}

TEST(GlooPlumbing, AJoiningWaitNeverOutlastsItsOwnTimeout) {
  gloo::rendezvous::HashStore inner;
  WatchfulStore store(inner, "g/abandoned", std::chrono::milliseconds(300));
  const absl::Time start = absl::Now();
  // The caller asks for a minute; the join's timeout wins.
  const absl::Status s =
      CatchGloo("join", [&] { store.wait({"g/never"}, std::chrono::minutes(1)); });
  EXPECT_FALSE(s.ok());
  EXPECT_LT(absl::Now() - start, absl::Seconds(5));
}

TEST(GlooPlumbing, AHostNameThatDoesNotResolveIsRefusedBeforeGlooSeesIt) {
  gloo::transport::tcp::attr attr;
  attr.hostname = "no-such-host.invalid";
  GlooEndpoint endpoint(std::make_shared<gloo::rendezvous::HashStore>(), attr);
  const absl::Status s = endpoint.Probe();
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
  EXPECT_NE(s.message().find("does not resolve"), std::string::npos) << s;
  EXPECT_FALSE(endpoint.opened());
}

}  // namespace
}  // namespace tessel::worker
