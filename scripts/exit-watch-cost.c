/* The cost of asking whether a pinned process has exited, per call:
 * poll(2) of its pidfd against epoll_wait(2) (zero timeout) on an epoll
 * instance watching it, with getppid(2) as the bare cost of a system call;
 * then that the epoll watch reports a kill before the reap, and after.
 * ferry-tcp's same-host copies make one such call before each copy
 * (crates/ferry-tcp/BENCHMARKS.md, row cma::Remote::alive).
 *
 *   cc -O2 scripts/exit-watch-cost.c -o /tmp/exit-watch-cost && /tmp/exit-watch-cost
 */
#define _GNU_SOURCE
#include <stdio.h>
#include <poll.h>
#include <sys/syscall.h>
#include <sys/epoll.h>
#include <unistd.h>
#include <time.h>
#include <signal.h>
#include <sys/wait.h>
static double now(){struct timespec t;clock_gettime(CLOCK_MONOTONIC,&t);return t.tv_sec*1e9+t.tv_nsec;}
int main(){
  pid_t c=fork(); if(!c){pause();return 0;}
  int fd=syscall(SYS_pidfd_open,c,0);
  int ep=epoll_create1(EPOLL_CLOEXEC); struct epoll_event ev={.events=EPOLLIN,.data.u64=1}; epoll_ctl(ep,EPOLL_CTL_ADD,fd,&ev);
  int N=2000000; double t;
  for(int r=0;r<3;r++){
  t=now(); for(int i=0;i<N;i++){struct pollfd p={fd,POLLIN,0}; poll(&p,1,0);} printf("poll %.0f ns\n",(now()-t)/N);
  t=now(); for(int i=0;i<N;i++){struct epoll_event e; epoll_wait(ep,&e,1,0);} printf("epoll_wait0 %.0f ns\n",(now()-t)/N);
  t=now(); for(int i=0;i<N;i++){syscall(SYS_getppid);} printf("getppid %.0f ns\n",(now()-t)/N);
  }
  struct epoll_event e; printf("before kill: %d\n", epoll_wait(ep,&e,1,0));
  kill(c,9); 
  // right after the kill, before reaping: readiness?
  for(int i=0;i<1000000;i++){ if(epoll_wait(ep,&e,1,0)==1){printf("epoll ready after %d tries\n",i);break;} }
  struct pollfd p={fd,POLLIN,0}; printf("poll says %d\n", poll(&p,1,0));
  waitpid(c,0,0);
  printf("after reap epoll %d %d\n", epoll_wait(ep,&e,1,0), epoll_wait(ep,&e,1,0));
  return 0;}
