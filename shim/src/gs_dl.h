/*
 * The shim's view of the dynamic linker's lookup functions: libc's own dlvsym (by its version, so
 * the shim's calls never reach the dlvsym it exports itself), and the shim's dlsym/dlvsym for a
 * lookup of those names, so neither is a way around the other.
 */
#ifndef GS_DL_H
#define GS_DL_H

/* libc's dlvsym. */
void *gs_libc_dlvsym(void *handle, const char *symbol, const char *version);

/* The shim's dlsym or dlvsym when `symbol` names one of them, else NULL. */
void *gs_dl_own(const char *symbol);

/* hook.c: what the shim's dlsym returns for a driver entry point's name found in `handle`. */
void *gs_dlsym_driver(void *handle, const char *symbol);

#endif
