#include "tessel/local_cluster.h"

#include <fcntl.h>
#include <grpcpp/grpcpp.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "core/security.h"
#include "tessel/v1/admin.grpc.pb.h"

namespace tessel {
namespace {

std::string SelfDir() {
  std::error_code ec;
  auto p = std::filesystem::read_symlink("/proc/self/exe", ec);
  return ec ? "." : p.parent_path().string();
}

absl::StatusOr<pid_t> Spawn(const std::string& binary, const std::vector<std::string>& args,
                            const std::string& log_path) {
  if (access(binary.c_str(), X_OK) != 0) {
    return absl::NotFoundError(
        absl::StrCat("cannot execute '", binary,
                     "': set TESSEL_BIN_DIR to the folder holding the tessel binaries"));
  }
  std::vector<char*> argv;
  argv.push_back(const_cast<char*>(binary.c_str()));
  for (const std::string& a : args) argv.push_back(const_cast<char*>(a.c_str()));
  argv.push_back(nullptr);
  const pid_t parent = getpid();
  pid_t pid = fork();
  if (pid < 0) return absl::InternalError("fork failed");
  if (pid == 0) {
    prctl(PR_SET_PDEATHSIG, SIGTERM);
    if (getppid() != parent) _exit(1);
    sigset_t none;
    sigemptyset(&none);
    pthread_sigmask(SIG_SETMASK, &none, nullptr);
    setpgid(0, 0);  // Ctrl-C in a terminal reaches the parent only; it stops us in order
    if (!log_path.empty()) {
      int fd = open(log_path.c_str(), O_WRONLY | O_CREAT | O_APPEND, 0644);
      if (fd >= 0) {
        dup2(fd, 1);
        dup2(fd, 2);
        close(fd);
      }
    }
    execv(binary.c_str(), argv.data());
    _exit(127);
  }
  return pid;
}

void StopProcess(pid_t pid) {
  if (pid <= 0) return;
  kill(pid, SIGTERM);
  for (int i = 0; i < 100; ++i) {
    if (waitpid(pid, nullptr, WNOHANG) == pid) return;
    absl::SleepFor(absl::Milliseconds(20));
  }
  kill(pid, SIGKILL);
  waitpid(pid, nullptr, 0);
}

}  // namespace

absl::StatusOr<std::unique_ptr<LocalCluster>> LocalCluster::Start(Options options) {
  if (options.workers < 1 || options.devices_per_worker < 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("local cluster: expected >= 1 workers and devices per worker, got ",
                     options.workers, " and ", options.devices_per_worker));
  }
  std::string bin = options.binary_dir;
  if (bin.empty()) {
    const char* env = std::getenv("TESSEL_BIN_DIR");
    bin = env != nullptr && *env != '\0' ? env : SelfDir();
  }
  auto cluster = std::unique_ptr<LocalCluster>(new LocalCluster());
  cluster->log_dir_ = options.log_dir;
  if (cluster->log_dir_.empty()) {
    char tmpl[] = "/tmp/tessel-local-XXXXXX";
    if (mkdtemp(tmpl) == nullptr) return absl::InternalError("mkdtemp failed");
    cluster->log_dir_ = tmpl;
    cluster->owns_log_dir_ = true;
  }
  std::filesystem::create_directories(cluster->log_dir_);
  const std::string port_file = cluster->log_dir_ + "/coordinator.port";
  std::filesystem::remove(port_file);
  auto log_for = [&](const std::string& name) {
    return options.inherit_output ? std::string() : cluster->log_dir_ + "/" + name + ".log";
  };
  std::vector<std::string> coordinator_args = {
      absl::StrCat("--port=", options.port), "--port_file=" + port_file,
      absl::StrCat("--heartbeat_timeout_ms=", options.heartbeat_timeout_ms)};
  coordinator_args.insert(coordinator_args.end(), options.coordinator_flags.begin(),
                          options.coordinator_flags.end());
  auto cpid = Spawn(bin + "/tessel-coordinator", coordinator_args, log_for("coordinator"));
  if (!cpid.ok()) return cpid.status();
  cluster->coordinator_pid_ = *cpid;
  int port = 0;
  for (absl::Time deadline = absl::Now() + absl::Seconds(15); port == 0;) {
    std::ifstream in(port_file);
    if (in >> port && port > 0) break;
    port = 0;
    if (waitpid(cluster->coordinator_pid_, nullptr, WNOHANG) == cluster->coordinator_pid_) {
      cluster->coordinator_pid_ = -1;
      return absl::InternalError(
          absl::StrCat("tessel-coordinator exited at start-up; see ", log_for("coordinator")));
    }
    if (absl::Now() > deadline)
      return absl::DeadlineExceededError("tessel-coordinator did not start within 15 s");
    absl::SleepFor(absl::Milliseconds(10));
  }
  cluster->address_ = absl::StrCat("127.0.0.1:", port);
  // Workers start one at a time, each registering before the next starts, so
  // worker i owns global devices [i*D, (i+1)*D).
  TlsFiles tls;
  tls.ca = options.tls_ca_file;
  auto admin = v1::Admin::NewStub(CreateChannelWithToken(cluster->address_, ChannelCredentials(tls),
                                                         grpc::ChannelArguments(), options.token));
  for (int i = 0; i < options.workers; ++i) {
    std::vector<std::string> args = {"--coordinator=" + cluster->address_,
                                     absl::StrCat("--devices=", options.devices_per_worker)};
    args.insert(args.end(), options.worker_flags.begin(), options.worker_flags.end());
    auto wpid = Spawn(bin + "/tessel-worker", args, log_for(absl::StrCat("worker", i)));
    if (!wpid.ok()) return wpid.status();
    cluster->worker_pids_.push_back(*wpid);
    for (absl::Time deadline = absl::Now() + absl::Seconds(30);;) {
      grpc::ClientContext ctx;
      ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(2));
      v1::GetClusterResponse resp;
      int alive = 0;
      if (admin->GetCluster(&ctx, v1::GetClusterRequest(), &resp).ok()) {
        for (const auto& w : resp.workers()) alive += w.alive();
      }
      if (alive == i + 1) break;
      if (waitpid(*wpid, nullptr, WNOHANG) == *wpid) {
        cluster->worker_pids_.back() = -1;
        return absl::InternalError(absl::StrCat("tessel-worker ", i, " exited at start-up; see ",
                                                log_for(absl::StrCat("worker", i))));
      }
      if (absl::Now() > deadline) {
        return absl::DeadlineExceededError(absl::StrCat(
            "worker ", i, " did not register within 30 s; logs in ", cluster->log_dir_));
      }
      absl::SleepFor(absl::Milliseconds(5));
    }
  }
  return cluster;
}

absl::Status LocalCluster::SignalWorker(int i, int sig) {
  if (i < 0 || i >= int(worker_pids_.size()) || worker_pids_[i] <= 0) {
    return absl::InvalidArgumentError(absl::StrCat("no worker ", i));
  }
  const pid_t pid = worker_pids_[i];
  if (kill(pid, sig) != 0) {
    return absl::InternalError(
        absl::StrCat("signal ", sig, " to worker ", i, " (pid ", pid, "): ", strerror(errno)));
  }
  // SIGSTOP takes effect when the kernel next schedules one of the worker's
  // threads, which on a loaded machine can be milliseconds later: a "paused"
  // worker would still take the next step. Wait until it has stopped.
  // (SIGCONT wakes the stopped threads as it is sent.)
  if (sig == SIGKILL) {
    waitpid(pid, nullptr, 0);
    worker_pids_[i] = -1;
  } else if (sig == SIGSTOP) {
    for (;;) {
      int status = 0;
      const pid_t got = waitpid(pid, &status, WUNTRACED);
      if (got == pid && WIFSTOPPED(status)) break;
      if (got == pid && (WIFEXITED(status) || WIFSIGNALED(status))) {
        worker_pids_[i] = -1;
        return absl::UnavailableError(
            absl::StrCat("worker ", i, " (pid ", pid, ") exited instead of stopping"));
      }
      if (got < 0 && errno != EINTR) {
        return absl::InternalError(
            absl::StrCat("waiting for worker ", i, " (pid ", pid, ") to stop: ", strerror(errno)));
      }
    }
  }
  return absl::OkStatus();
}

void LocalCluster::Stop() {
  // The coordinator first: it closes its step streams to the workers, which
  // then shut down without waiting on them.
  StopProcess(coordinator_pid_);
  coordinator_pid_ = -1;
  for (pid_t& p : worker_pids_) {
    StopProcess(p);
    p = -1;
  }
}

LocalCluster::~LocalCluster() {
  Stop();
  if (owns_log_dir_ && std::getenv("TESSEL_KEEP_LOGS") == nullptr) {
    std::error_code ec;
    std::filesystem::remove_all(log_dir_, ec);
  }
}

}  // namespace tessel
