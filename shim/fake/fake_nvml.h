/* What the fake libnvidia-ml.so.1's two files share (fake_nvml.c, fake_nvml_health.c): the checks
 * every call on a card makes first. */
#ifndef FAKE_NVML_H
#define FAKE_NVML_H

#include <nvml.h>

int fake_nvml_initialized(void);

/* The visible index of the card behind a handle, after the checks in NVML's order: the library
 * initialized, a handle to one of this machine's cards, that card not lost. -1 with the error to
 * return in *rc when one fails. */
int fake_nvml_card(nvmlDevice_t dev, nvmlReturn_t *rc);

/* Declares int i, the card's visible index, or returns the failed check's error. */
#define GET_CARD(dev, i)                                                                                 \
    nvmlReturn_t i##_rc_;                                                                                \
    int i = fake_nvml_card(dev, &i##_rc_);                                                               \
    if (i < 0) return i##_rc_

/* The same checks where the card itself is not needed. */
#define CHECK_CARD(dev)                                                                                  \
    do {                                                                                                 \
        nvmlReturn_t rc_;                                                                                \
        if (fake_nvml_card(dev, &rc_) < 0) return rc_;                                                   \
    } while (0)

#endif
