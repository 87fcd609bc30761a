/* One copy into another process, per call: process_vm_writev(2) alone, the
 * exit-watch question (epoll_wait(2) with a zero timeout on an epoll
 * instance watching the process's pidfd) followed by process_vm_writev,
 * and pwrite(2) of its /proc/PID/mem; then what the mem file does once its
 * process has exited and been reaped (the kernel moves nothing: 0).
 * Blocks cycle through 64 MiB (memory out of the CPU caches).
 * ferry-tcp's same-host copies of one range of at most one page go through
 * the mem file (crates/ferry-tcp/BENCHMARKS.md, row cma::MEM_FILE_MAX).
 *
 *   cc -O2 scripts/proc-mem-cost.c -o /tmp/proc-mem-cost
 *   for b in 4096 8192 16384 65536; do /tmp/proc-mem-cost $b 50000; done
 */
#define _GNU_SOURCE
#include <fcntl.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/epoll.h>
#include <sys/mman.h>
#include <sys/syscall.h>
#include <sys/uio.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

static double now(void) {
  struct timespec t;
  clock_gettime(CLOCK_MONOTONIC, &t);
  return t.tv_sec * 1e9 + t.tv_nsec;
}

int main(int argc, char **argv) {
  size_t len = argc > 1 ? (size_t)atol(argv[1]) : 4096;
  int n = argc > 2 ? atoi(argv[2]) : 100000;
  size_t span = 64 << 20, slots = span / len;
  char *dst = mmap(0, span, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0);
  memset(dst, 1, span);
  pid_t child = fork();
  if (!child) {
    pause();
    _exit(0);
  }
  char *src = malloc(span);
  memset(src, 2, span);
  int pidfd = syscall(SYS_pidfd_open, child, 0);
  int ep = epoll_create1(EPOLL_CLOEXEC);
  struct epoll_event ev = {.events = EPOLLIN};
  epoll_ctl(ep, EPOLL_CTL_ADD, pidfd, &ev);
  char path[64];
  snprintf(path, sizeof path, "/proc/%d/mem", child);
  int mem = open(path, O_RDWR | O_CLOEXEC);
  if (mem < 0) {
    perror("open /proc/PID/mem");
    return 1;
  }
  for (int round = 0; round < 3; round++) {
    double t = now();
    for (int i = 0; i < n; i++) {
      size_t o = (i % slots) * len;
      struct iovec l = {src + o, len}, r = {dst + o, len};
      if (process_vm_writev(child, &l, 1, &r, 1, 0) != (ssize_t)len) return 2;
    }
    double bare = (now() - t) / n;
    t = now();
    for (int i = 0; i < n; i++) {
      size_t o = (i % slots) * len;
      struct epoll_event e;
      if (epoll_wait(ep, &e, 1, 0) != 0) return 3;
      struct iovec l = {src + o, len}, r = {dst + o, len};
      if (process_vm_writev(child, &l, 1, &r, 1, 0) != (ssize_t)len) return 2;
    }
    double asked = (now() - t) / n;
    t = now();
    for (int i = 0; i < n; i++) {
      size_t o = (i % slots) * len;
      if (pwrite(mem, src + o, len, (off_t)(dst + o)) != (ssize_t)len) return 4;
    }
    double file = (now() - t) / n;
    printf("%zu bytes: process_vm_writev %.0f ns, epoll_wait + process_vm_writev %.0f ns, "
           "/proc/PID/mem %.0f ns\n", len, bare, asked, file);
  }
  kill(child, SIGKILL);
  waitpid(child, 0, 0);
  printf("after the exit and the reap, pwrite of the mem file moves %zd bytes\n",
         pwrite(mem, src, 16, (off_t)dst));
  return 0;
}
