/* glibc_compat.h: bind the few glibc symbols whose default version moved in glibc 2.34 to their
 * original versions, so one wheel built on a new distribution loads on old ones.
 *
 * glibc 2.34 folded libdl and libpthread into libc and gave dlopen, pthread_create & co. a new
 * default version (GLIBC_2.34). Linking against it would make the extension refuse to load on
 * any glibc before 2.34 (RHEL 8, Ubuntu 20.04, most clusters) and auditwheel would have to tag
 * the wheel manylinux_2_34. The original versions are still exported by every glibc, so the
 * extension asks for those (only for symbols ampx uses: an unused one would be harmless, but
 * pthread_atfork, for one, lives in libc_nonshared.a and has no old version to bind). setup.py force-includes this header into every C file on Linux;
 * scripts/check_package.sh checks that no symbol newer than GLIBC_2.17 is left.
 */
#ifndef AMPX_GLIBC_COMPAT_H
#define AMPX_GLIBC_COMPAT_H

#if defined(__linux__) && !defined(AMPX_NO_GLIBC_COMPAT)
#  if defined(__x86_64__)
#    define AMPX_GLIBC_BASE "GLIBC_2.2.5"
#  elif defined(__aarch64__)
#    define AMPX_GLIBC_BASE "GLIBC_2.17"
#  endif
#  ifdef AMPX_GLIBC_BASE
#    define AMPX_OLD_SYMBOL(name) __asm__(".symver " #name "," #name "@" AMPX_GLIBC_BASE);
AMPX_OLD_SYMBOL(dlopen)
AMPX_OLD_SYMBOL(dlsym)
AMPX_OLD_SYMBOL(dlerror)
AMPX_OLD_SYMBOL(dlclose)
AMPX_OLD_SYMBOL(pthread_create)
AMPX_OLD_SYMBOL(pthread_once)
AMPX_OLD_SYMBOL(pthread_mutex_trylock)
#    undef AMPX_OLD_SYMBOL
#  endif
#endif

#endif
