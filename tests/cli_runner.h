// Runs the tpsim binary as a user would and captures what it says.
#pragma once

#include <array>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <string>
#include <sys/wait.h>
#include <unistd.h>

namespace tpsim::testing {

struct CliResult {
  int exit_code = -1;
  std::string out;  // stdout and stderr together
};

// `shell` runs first in the same shell, e.g. "ulimit -v 1000000;".
inline CliResult run_tpsim(const std::string& args, const std::string& shell = "") {
  const std::string cmd = shell + " " + std::string(TPSIM_BINARY) + " " + args + " 2>&1";
  CliResult r;
  FILE* p = popen(cmd.c_str(), "r");
  if (!p) return r;
  std::array<char, 4096> buf;
  std::size_t n;
  while ((n = fread(buf.data(), 1, buf.size(), p)) > 0) r.out.append(buf.data(), n);
  const int status = pclose(p);
  r.exit_code = WIFEXITED(status) ? WEXITSTATUS(status) : -1;
  return r;
}

// A file in a directory of this test process's own: ctest runs test cases as parallel
// processes, and two test runs may share a machine.
inline std::string temp_path(const std::string& name) {
  auto dir = std::filesystem::temp_directory_path() /
             ("tpsim-tests-" + std::to_string(static_cast<long>(getpid())));
  std::filesystem::create_directories(dir);
  return (dir / name).string();
}

// Whether `value` is one of the '|'-separated `alternatives`.
inline bool one_of(const std::string& alternatives, const std::string& value) {
  std::size_t start = 0;
  while (true) {
    const auto end = alternatives.find('|', start);
    if (alternatives.substr(start, end - start) == value) return true;
    if (end == std::string::npos) return false;
    start = end + 1;
  }
}

inline nlohmann::json read_json(const std::string& path) {
  std::ifstream f(path);
  return nlohmann::json::parse(f);
}

}  // namespace tpsim::testing
