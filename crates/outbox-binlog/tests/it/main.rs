mod capture;
mod compressed;
mod mariadb;
mod seat;
