#include "verify/setup/run_options.h"

namespace tpsim {

const char* batch_kind_name(BatchKind b) { return b == BatchKind::Random ? "random" : "boundary"; }

}  // namespace tpsim
