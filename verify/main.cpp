#include "verify/cli.h"

int main(int argc, char** argv) { return tpsim::cli_main(argc, argv); }
