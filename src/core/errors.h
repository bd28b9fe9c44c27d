// Errors as exceptions that say what failed, where, and why. Library code never exits;
// the CLI maps each class to a documented exit code (README.md, "Exit codes").
#pragma once

#include <stdexcept>
#include <string>

namespace tpsim {

// Base of every tpsim error. The message is one line: "<where>: <what and why>".
class Error : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

// The caller asked for something impossible: a bad flag, an unsupported TP degree, a
// malformed or mismatched input file. CLI exit code 2.
class UsageError : public Error {
 public:
  using Error::Error;
};

// Something went wrong while running: a collective timed out or was aborted, a rank
// threw, a device call failed. CLI exit code 3.
class RuntimeFailure : public Error {
 public:
  using Error::Error;
};

// A collective could not complete (timeout, abort, or ranks that disagree on the call).
class CommError : public RuntimeFailure {
 public:
  using RuntimeFailure::RuntimeFailure;
};

}  // namespace tpsim
