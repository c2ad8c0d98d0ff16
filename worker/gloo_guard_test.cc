// The guard for Gloo's connect (worker/gloo_guard.h), against Gloo's own TCP
// transport: a connection that its peer resets before Gloo's event loop
// takes it must fail its pair, not terminate the process.
#include "worker/gloo_guard.h"

#include <arpa/inet.h>
#include <gloo/common/error.h>
#include <gloo/transport/tcp/address.h>
#include <gloo/transport/tcp/device.h>
#include <gloo/transport/tcp/loop.h>
#include <gtest/gtest.h>
#include <netinet/in.h>
#include <signal.h>
#include <sys/epoll.h>
#include <sys/eventfd.h>
#include <sys/socket.h>
#include <unistd.h>

#include <chrono>
#include <cstring>
#include <string>
#include <thread>

#include "absl/synchronization/notification.h"

namespace tessel::worker {
namespace {

// Holds a Gloo device's event loop inside its first call, until released.
class LoopStall : public gloo::transport::tcp::Handler {
 public:
  explicit LoopStall(gloo::transport::tcp::Device& device)
      : device_(device), fd_(eventfd(1, EFD_NONBLOCK)) {
    device_.registerDescriptor(fd_, EPOLLIN, this);
    entered_.WaitForNotification();
  }
  ~LoopStall() override {
    Release();
    device_.unregisterDescriptor(fd_, this);
    close(fd_);
  }
  void Release() {
    if (!released_.HasBeenNotified()) released_.Notify();
  }
  void handleEvents(int) override {
    uint64_t v;
    (void)!read(fd_, &v, sizeof(v));
    if (entered_.HasBeenNotified()) return;
    entered_.Notify();
    released_.WaitForNotification();
  }

 private:
  gloo::transport::tcp::Device& device_;
  const int fd_;
  absl::Notification entered_, released_;
};

TEST(GlooGuard, IsActiveInThisExecutable) { EXPECT_TRUE(GlooPeerNameGuardActive()); }

TEST(GlooGuard, AConnectionResetBeforeTheLoopTakesItFailsItsPairAndTheProcessGoesOn) {
  // Posting a receive writes a notice to the peer; on the reset connection
  // that write fails with EPIPE, as in the daemons, which ignore SIGPIPE
  // (tessel::BlockTerminationSignals).
  signal(SIGPIPE, SIG_IGN);
  gloo::transport::tcp::attr attr;
  attr.hostname = "127.0.0.1";
  std::shared_ptr<gloo::transport::Device> device = gloo::transport::tcp::CreateDevice(attr);
  auto* tcp = dynamic_cast<gloo::transport::tcp::Device*>(device.get());
  ASSERT_NE(tcp, nullptr);
  std::shared_ptr<gloo::transport::Context> context = device->createContext(/*rank=*/0, /*size=*/2);
  context->setTimeout(std::chrono::seconds(20));
  const int64_t resets_before = GlooConnectionsResetDuringSetup();

  auto stall = std::make_unique<LoopStall>(*tcp);
  // Pair 0 -> 1 listens: a peer address above its own makes it the accepting side.
  auto& pair = context->createPair(1);
  const auto& listening = dynamic_cast<const gloo::transport::tcp::Address&>(pair->address());
  sockaddr_storage peer_ss{};
  auto* peer_in = reinterpret_cast<sockaddr_in*>(&peer_ss);
  peer_in->sin_family = AF_INET;
  peer_in->sin_port = htons(65535);
  peer_in->sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  const gloo::transport::tcp::Address peer(peer_ss, listening.getSeq());

  std::string connect_error = "(connect has not returned)";
  std::thread connecting([&] {
    try {
      pair->connect(peer.bytes());
      connect_error.clear();
    } catch (const std::exception& e) {
      connect_error = e.what();
    }
  });

  // A client connects (the kernel queues the connection on the listener) and
  // resets it, all while Gloo's loop is held.
  const int client = socket(AF_INET, SOCK_STREAM, 0);
  ASSERT_NE(client, -1);
  const sockaddr_storage& to = listening.getSockaddr();
  ASSERT_EQ(connect(client, reinterpret_cast<const sockaddr*>(&to), sizeof(sockaddr_in)), 0)
      << std::strerror(errno);
  const linger abort_on_close{1, 0};
  ASSERT_EQ(setsockopt(client, SOL_SOCKET, SO_LINGER, &abort_on_close, sizeof(abort_on_close)), 0);
  close(client);

  stall->Release();  // the loop now accepts the reset connection
  connecting.join();
  EXPECT_EQ(GlooConnectionsResetDuringSetup(), resets_before + 1);
  // The pair was set up without a peer address (or failed outright); either
  // way its first use fails with Gloo's IO error, promptly, not a timeout:
  // posting the receive throws if Gloo's loop has already read the reset,
  // waiting for it throws if not.
  if (connect_error.empty()) {
    std::vector<char> data(16);
    auto buffer = context->createUnboundBuffer(data.data(), data.size());
    const auto start = std::chrono::steady_clock::now();
    try {
      buffer->recv(1, /*slot=*/7);
      buffer->waitRecv(std::chrono::seconds(10));
      ADD_FAILURE() << "a recv on a reset connection completed";
    } catch (const gloo::IoException& e) {
      EXPECT_EQ(std::string(e.what()).find("Timed out"), std::string::npos) << e.what();
    }
    EXPECT_LT(std::chrono::steady_clock::now() - start, std::chrono::seconds(5));
  } else {
    EXPECT_NE(connect_error.find("reset"), std::string::npos) << connect_error;
  }
  stall.reset();

  // The device still connects pairs.
  std::shared_ptr<gloo::transport::Context> a = device->createContext(0, 2);
  std::shared_ptr<gloo::transport::Context> b = device->createContext(1, 2);
  auto& pa = a->createPair(1);
  auto& pb = b->createPair(0);
  std::thread ta([&] { pa->connect(pb->address().bytes()); });
  pb->connect(pa->address().bytes());
  ta.join();
  int value = 42, got = 0;
  auto send = a->createUnboundBuffer(&value, sizeof(value));
  auto recv = b->createUnboundBuffer(&got, sizeof(got));
  recv->recv(0, /*slot=*/1);
  send->send(1, /*slot=*/1);
  send->waitSend(std::chrono::seconds(10));
  recv->waitRecv(std::chrono::seconds(10));
  EXPECT_EQ(got, 42);
}

}  // namespace
}  // namespace tessel::worker
