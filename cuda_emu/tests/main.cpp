// The self-tests' runner: the emulator alone, without tpsim's libraries.
#define CATCH_CONFIG_MAIN
#include <catch2/catch.hpp>
