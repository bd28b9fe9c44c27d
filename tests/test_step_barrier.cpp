// StepBarrier: the bookkeeping that holds the reference (and --tp-invariant's tp 1) back
// until every reader has finished a step, whatever order the readers finish in and
// whichever of them stops reading early.
#include <catch2/catch.hpp>

#include "verify/engine/step_barrier.h"

using namespace tpsim;

TEST_CASE("StepBarrier passes a step once every reader has finished it", "[verify][barrier]") {
  StepBarrier b(2);
  CHECK(b.passed(0));  // nothing to wait for before step 1
  CHECK_FALSE(b.passed(1));
  b.done(1);
  CHECK_FALSE(b.passed(1));  // one of two readers
  b.done(1);
  CHECK(b.passed(1));
  CHECK_FALSE(b.passed(2));
}

TEST_CASE("StepBarrier lets a fast reader run ahead without passing the slow one's step",
          "[verify][barrier]") {
  StepBarrier b(2);
  b.done(1);
  b.done(2);  // the fast reader, two steps in
  CHECK_FALSE(b.passed(1));
  b.done(1);  // the slow one catches up to step 1
  CHECK(b.passed(1));
  CHECK_FALSE(b.passed(2));
  b.done(2);
  CHECK(b.passed(2));
}

TEST_CASE("StepBarrier stops waiting for a reader that retires", "[verify][barrier]") {
  StepBarrier b(3);
  b.done(1);
  b.done(1);
  b.done(2);
  b.done(2);
  // The third reader finished step 1 only, then failed: steps 1 and 2 are now done by
  // every reader still reading, and its own step 1 must not count twice.
  b.done(1);
  b.retire(1);
  CHECK(b.passed(2));
  CHECK_FALSE(b.passed(3));
}

TEST_CASE("StepBarrier retiring a reader that finished a step does not count it again",
          "[verify][barrier]") {
  StepBarrier b(3);
  b.done(1);  // reader A
  b.done(2);  // reader A
  b.retire(2);  // reader A stops after step 2
  b.done(1);  // reader B
  CHECK_FALSE(b.passed(1));  // reader C has not finished step 1
  b.done(1);  // reader C
  CHECK(b.passed(1));
  CHECK_FALSE(b.passed(2));
  b.done(2);  // reader B: A's step 2 no longer counts, C has not finished it
  CHECK_FALSE(b.passed(2));
  b.done(2);  // reader C
  CHECK(b.passed(2));
}

TEST_CASE("StepBarrier passes everything once closed or once every reader retires",
          "[verify][barrier]") {
  StepBarrier closed(2);
  closed.close();
  CHECK(closed.passed(100));
  StepBarrier gone(1);
  gone.retire(0);
  CHECK(gone.passed(100));
}
