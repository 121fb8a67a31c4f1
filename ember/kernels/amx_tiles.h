// The AMX tile configuration (palette 1) that _tile_loadconfig takes, shared by the kernels that use tiles.
#pragma once
#include <stdint.h>
#include <string.h>

typedef struct {
    uint8_t palette_id;
    uint8_t start_row;
    uint8_t reserved[14];
    uint16_t colsb[16];  // bytes per row of each tile (0: unconfigured)
    uint8_t rows[16];
} __attribute__((packed, aligned(64))) tile_config;

// Palette 1 with every tile unconfigured; the caller sets the tiles it uses.
static inline tile_config empty_tile_config(void) {
    tile_config config;
    memset(&config, 0, sizeof(config));
    config.palette_id = 1;
    return config;
}
