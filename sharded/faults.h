// Moved to sharded/faults/faults.h; this forward stays for sharded/moe_layer.h, which
// another change is splitting, until that lands.
#pragma once

#include "sharded/faults/faults.h"
