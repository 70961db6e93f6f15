// Running a program as a child process from a test: its stdout and stderr
// captured together, an optional SIGTERM once a line appears in its output,
// and an optional timeout so a test never hangs.
//
//   ProcessResult r = run_process({TRAINER_BINARY, "train", recipe}, {.stop_after = "step 10/40"});
//   INFO(r.output);
//   REQUIRE(r.code == 0);
#pragma once

#include <fcntl.h>
#include <netinet/in.h>
#include <poll.h>
#include <signal.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <random>
#include <sstream>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "tests/testing.h"

namespace trainer::testing {

struct ProcessResult {
  int code = -1;       // exit code, 128 + signal when killed
  std::string output;  // stdout and stderr
  double seconds = 0;
  // The lines of output saying why a run failed (errors, the launcher's
  // report, a crash), first in a failed test's messages: a long output
  // printed whole is cut in the middle by logs that keep its ends.
  std::string failure_lines() const {
    std::string lines, line;
    for (size_t begin = 0; begin < output.size();) {
      size_t end = output.find('\n', begin);
      if (end == std::string::npos) end = output.size();
      line = output.substr(begin, end - begin);
      begin = end + 1;
      for (const char* mark : {"error", "trainer launch:", "terminate", "Aborted", "Segmentation",
                               "cannot", "timed out"})
        if (line.find(mark) != std::string::npos) {
          lines += line + "\n";
          break;
        }
    }
    return lines.empty() ? "(no error lines)" : lines;
  }
};

struct ProcessOptions {
  std::vector<std::pair<std::string, std::string>> env{};  // set in the child
  // Non-empty: SIGTERM to the child once its output contains this text.
  std::string stop_after{};
  // > 0: SIGTERM to the child's process group after this many seconds, SIGKILL 15 s later.
  double timeout_s = 0;
};

// Runs argv (argv[0] is the program's path) in its own process group and waits for it.
// Tests call it from several threads at once (one per rank), and Catch's
// assertions are not thread-safe: a pipe or fork that fails is a result
// (code -1, the reason as output) for the caller's REQUIRE on its own thread.
inline ProcessResult run_process(const std::vector<std::string>& argv,
                                 const ProcessOptions& options = {}) {
  auto failed = [](const char* what) {
    return ProcessResult{-1, std::string("run_process: ") + what + ": " + std::strerror(errno)};
  };
  int out[2];
  if (::pipe2(out, O_CLOEXEC) != 0) return failed("pipe2");  // dup2 below clears it on 1 and 2
  auto start = std::chrono::steady_clock::now();
  pid_t pid = ::fork();
  if (pid < 0) {
    ProcessResult r = failed("fork");
    ::close(out[0]);
    ::close(out[1]);
    return r;
  }
  if (pid == 0) {
    ::setpgid(0, 0);
    ::dup2(out[1], 1);
    ::dup2(out[1], 2);
    ::close(out[0]);
    for (const auto& [k, v] : options.env) ::setenv(k.c_str(), v.c_str(), 1);
    std::vector<char*> args;
    for (const std::string& a : argv) args.push_back(const_cast<char*>(a.c_str()));
    args.push_back(nullptr);
    ::execv(args[0], args.data());
    ::_exit(127);
  }
  ::close(out[1]);
  ::fcntl(out[0], F_SETFL, O_NONBLOCK);
  ProcessResult r;
  int status = 0;
  bool open = true, stopped = false, timed_out = false;
  for (;;) {
    // Reaped first, then read: everything the child wrote before exiting is in the pipe.
    bool exited = ::waitpid(pid, &status, WNOHANG) == pid;
    char buf[4096];
    ssize_t n = 0;
    while (open && (n = ::read(out[0], buf, sizeof buf)) > 0) r.output.append(buf, size_t(n));
    if (n == 0) open = false;  // every writer closed it
    if (exited) break;
    if (!options.stop_after.empty() && !stopped &&
        r.output.find(options.stop_after) != std::string::npos) {
      ::kill(pid, SIGTERM);
      stopped = true;
    }
    double elapsed =
        std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    if (options.timeout_s > 0 && elapsed > options.timeout_s && !timed_out) {
      ::kill(-pid, SIGTERM);
      timed_out = true;
    }
    if (timed_out && elapsed > options.timeout_s + 15) ::kill(-pid, SIGKILL);
    if (open) {
      pollfd p{out[0], POLLIN, 0};
      ::poll(&p, 1, 10);
    } else {
      std::this_thread::sleep_for(std::chrono::milliseconds(10));
    }
  }
  ::close(out[0]);
  r.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  r.code = WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
  if (timed_out) r.output += "\n(the test stopped it after the timeout)";
  return r;
}

#ifdef TRAINER_BINARY
// Runs `trainer args...`, the binary under test.
inline ProcessResult run_trainer(const std::vector<std::string>& args,
                                 const ProcessOptions& options = {}) {
  std::vector<std::string> argv{TRAINER_BINARY};
  argv.insert(argv.end(), args.begin(), args.end());
  return run_process(argv, options);
}
#endif

// A child started in its own process group, its stdout and stderr in a
// temporary file (for children that run alongside the test, or several at
// once); output_of reads what it printed so far.
struct Child {
  pid_t pid = -1;
  std::string output_path;
};

inline Child start(const std::vector<std::string>& argv,
                   const std::vector<std::pair<std::string, std::string>>& env = {}) {
  char path[] = "/tmp/test_child_XXXXXX";
  int out = ::mkstemp(path);
  REQUIRE(out >= 0);
  pid_t pid = ::fork();
  REQUIRE(pid >= 0);
  if (pid == 0) {
    ::setpgid(0, 0);
    ::dup2(out, 1);
    ::dup2(out, 2);
    for (const auto& [k, v] : env) ::setenv(k.c_str(), v.c_str(), 1);
    std::vector<char*> args;
    for (const std::string& a : argv) args.push_back(const_cast<char*>(a.c_str()));
    args.push_back(nullptr);
    ::execv(args[0], args.data());
    ::_exit(127);
  }
  ::close(out);
  return Child{pid, path};
}

inline std::string output_of(const Child& c) {
  std::ifstream in(c.output_path);
  std::stringstream text;
  text << in.rdbuf();
  return text.str();
}

// Waits for the child, stopping its process group after timeout_s so a test never hangs.
inline ProcessResult finish(const Child& c, double timeout_s) {
  const auto t0 = std::chrono::steady_clock::now();
  auto elapsed = [&] {
    return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  };
  int status = 0;
  bool killed = false;
  while (::waitpid(c.pid, &status, WNOHANG) != c.pid) {
    if (elapsed() > timeout_s && !killed) {
      ::kill(-c.pid, SIGKILL);
      killed = true;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  ProcessResult r;
  r.code = WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
  r.output = output_of(c);
  r.seconds = elapsed();
  if (killed) r.output += "\n(the test stopped it after the timeout)";
  ::unlink(c.output_path.c_str());
  return r;
}

// Polls the child's output until it contains text (false after timeout_s).
inline bool wait_for_output(const Child& c, const std::string& text, double timeout_s) {
  const auto t0 = std::chrono::steady_clock::now();
  while (std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count() < timeout_s) {
    if (output_of(c).find(text) != std::string::npos) return true;
    siginfo_t info{};  // exited without printing it? (WNOWAIT: finish() still reaps it)
    if (::waitid(P_PID, id_t(c.pid), &info, WEXITED | WNOHANG | WNOWAIT) == 0 &&
        info.si_pid == c.pid)
      return output_of(c).find(text) != std::string::npos;
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  return false;
}

// The child of `trainer launch` (pid launcher) whose environment says RANK=rank (-1 if none).
inline pid_t launched_rank(pid_t launcher, int rank) {
  std::ifstream children("/proc/" + std::to_string(launcher) + "/task/" + std::to_string(launcher) +
                         "/children");
  pid_t pid;
  while (children >> pid) {
    std::ifstream env("/proc/" + std::to_string(pid) + "/environ");
    std::string var;
    while (std::getline(env, var, '\0'))
      if (var == "RANK=" + std::to_string(rank)) return pid;
  }
  return -1;
}

// True if a TCP socket can bind this loopback port now.
inline bool port_is_free(int port) {
  int fd = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  REQUIRE(fd >= 0);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  addr.sin_port = htons(uint16_t(port));
  const bool free = ::bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof addr) == 0;
  ::close(fd);
  return free;
}

// A free TCP port of this host for a rendezvous the test sets up itself,
// with the `count` - 1 ports after it free too. It is drawn below the
// kernel's ephemeral range (ip_local_port_range): a port from that range
// can be taken by any outgoing connection of a test running alongside
// between this check and the bind of the process that serves it.
inline int free_port(int count = 1) {
  int low = 32768;
  std::ifstream("/proc/sys/net/ipv4/ip_local_port_range") >> low;
  const int first = 10000, last = std::max(first + 1000, low) - count;
  std::random_device device;
  for (int attempt = 0; attempt < 1000; ++attempt) {
    const int port = first + int(device() % unsigned(last - first));
    bool free = true;
    for (int i = 0; i < count && free; ++i) free = port_is_free(port + i);
    if (free) return port;
  }
  FAIL("no " << count << " free consecutive TCP ports in [" << first << ", " << last << ")");
  return -1;
}

}  // namespace trainer::testing
