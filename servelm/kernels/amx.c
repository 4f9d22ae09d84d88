/* The AMX helpers of amx.h. Built at first use by servelm/kernels. */
#include "amx.h"

#ifdef KERNELS_AMX
#include <stdint.h>
#include <string.h>
#include <sys/syscall.h>
#include <unistd.h>

static int permission = -1; /* not asked yet; then 1 granted, 0 refused (a race asks twice, harmlessly) */

int amx_granted(void) {
    if (permission < 0) permission = syscall(SYS_arch_prctl, 0x1023, 18) == 0;
    return permission;
}

struct tile_config {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
};

void amx_configure(void) {
    struct tile_config cfg __attribute__((aligned(64)));
    memset(&cfg, 0, sizeof cfg);
    cfg.palette = 1;
    for (int t = 0; t < 8; t++) {
        cfg.colsb[t] = 64;
        cfg.rows[t] = 16;
    }
    /* GCC 12 does not see that ldtilecfg reads cfg, and dropped the stores above (the tiles then stayed
     * unconfigured, and the first tile instruction raised SIGILL): a barrier that reads it keeps them. */
    __asm__ volatile("" : : "m"(cfg) : "memory");
    _tile_loadconfig(&cfg);
}
#endif
